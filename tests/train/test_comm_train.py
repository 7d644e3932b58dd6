"""Training runs with a compressed reduction or DiLoCo on 4 replicas x 2 data: a resume from a checkpoint
in the middle of a DiLoCo interval equals the uninterrupted run bitwise, after a sync every replica holds
the global params, and a restore on another number of replicas is refused with one line."""

import os
import shutil

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import checkpoint, metrics
from jaxtrain.config import ConfigError
from jaxtrain import builder
from tests.fixtures import tiny_config


def restored(cfg, workdir):
  mesh, task, tx, _ = builder.build(cfg, workdir)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, read_only=True)
  state = builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  return jax.device_get(state)


def resumes_bitwise(tmp_path, cfg):
  """Trains `cfg` for 6 steps (checkpoint at 3), reruns from step 3; returns the straight run's workdir."""
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  losses = lambda d: [r["loss"] for r in metrics.read_metrics(d) if "loss" in r]
  assert losses(resumed) == losses(straight)[3:]
  a, b = restored(cfg, straight), restored(cfg, resumed)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
  jax.tree.map(np.testing.assert_array_equal, a.opt_state, b.opt_state)
  return straight, a


@pytest.mark.slow  # three runs: the default suite measured 10m08s with it (limit 10 minutes on 2 cores)
def test_streaming_diloco_resumes_mid_interval_bitwise_and_refuses_other_replica_counts(tmp_path):
  # H=4 in 2 fragments (one every 2 steps), each landing a step late: step 3 is mid-interval, with a
  # fragment's int8 average in flight
  cfg = tiny_config(mesh=dict(replica=4, data=2), train=dict(steps=6, batch_size=16),
                    checkpoint=dict(every_steps=3), diloco=dict(inner_steps=4, fragments=2, delay=1, format="int8"))
  straight, state = resumes_bitwise(tmp_path, cfg)
  rows = [r for r in metrics.read_metrics(straight) if "loss" in r]
  assert rows[0]["comm_bytes_replica"] > 0 and int(state.opt_state.syncs) == 3
  local = state.opt_state.local_params
  assert jax.tree.leaves(local)[0].shape[0] == 4  # one copy per replica, in the optimizer state
  with pytest.raises(ConfigError, match=r"4 shards on the replica axis .* set --config.mesh.replica=4"):
    jaxtrain.train(tiny_config(**{**dict(cfg), "mesh": dict(replica=2, data=4)}), straight, progress=False)


@pytest.mark.slow  # the transformation-level test (tests/optim/test_diloco.py) runs by default
def test_after_a_sync_every_replica_holds_the_global_params(tmp_path):
  cfg = tiny_config(mesh=dict(replica=4, data=2), train=dict(steps=4, batch_size=16),
                    diloco=dict(inner_steps=2, format="int8"))
  jaxtrain.train(cfg, str(tmp_path), progress=False, sync_every_step=True)
  state = restored(cfg, str(tmp_path))
  for r in range(4):
    jax.tree.map(lambda l, g: np.testing.assert_array_equal(l[r], g), state.opt_state.local_params, state.params)


@pytest.mark.slow
def test_int4_ef21_resumes_bitwise(tmp_path):
  cfg = tiny_config(mesh=dict(replica=4, data=2), train=dict(steps=6, batch_size=16),
                    checkpoint=dict(every_steps=3), comm=dict(format="int4", error_feedback="ef21", block=64))
  _, state = resumes_bitwise(tmp_path, cfg)
  assert np.any(state.opt_state[0].residual)  # the residuals travelled through the checkpoint
