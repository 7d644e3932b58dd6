"""The gradient-reduction seam: with optim.reduce_axis the step differentiates each data shard's rows
inside shard_map and the optimizer chain's first transformation reduces them; the result equals the
implicit (GSPMD) reduction up to float reassociation."""

import jax
import numpy as np
import optax
import pytest

import jaxtrain
from jaxtrain import checkpoint, metrics, optim
from jaxtrain.config import ConfigError
from jaxtrain import builder
from tests.fixtures import tiny_config


def run(tmp_path, name, reduce_axis):
  cfg = tiny_config(mesh=dict(data=4, fsdp=2), train=dict(steps=4, batch_size=16, microbatches=2, eval_every=0),
                    optim=dict(reduce_axis=reduce_axis))
  workdir = str(tmp_path / name)
  jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  mesh, task, tx, _ = builder.build(cfg, workdir)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, read_only=True)
  state = builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  return rows, jax.device_get(state.params), state.opt_state


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_explicit_sum_over_data_equals_the_implicit_reduction(tmp_path):
  implicit, p_implicit, _ = run(tmp_path, "implicit", "")
  explicit, p_explicit, opt_state = run(tmp_path, "explicit", "data")
  for key in ("loss", "grad_norm", "update_norm", "param_norm", "tokens"):
    np.testing.assert_allclose([r[key] for r in explicit], [r[key] for r in implicit], rtol=2e-5, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_explicit, p_implicit)
  # the reduction is the first transformation of the chain, and its state is found by name
  assert isinstance(opt_state[0], optim.reduce.ReduceState)
  assert float(optax.tree_utils.tree_get(opt_state, "grad_norm")) == pytest.approx(explicit[-1]["grad_norm"])


def test_reduce_axis_must_be_a_data_axis():
  with pytest.raises(ConfigError, match="optim.reduce_axis"):
    jaxtrain.validate(tiny_config(optim=dict(reduce_axis="fsdp")), 8)
