"""train.steps_per_call: K optimizer steps in one jitted program (a scan over K batches fed together) are
bitwise the K steps one call each, for plain data parallelism and for streaming DiLoCo (per-replica metrics, a
fragment in flight); calls end where a save is due, and the steps before it run singly; every step is logged;
a resumed run equals the uninterrupted one; tasks that build their batch from the params are refused."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import builder, parallel
from jaxtrain.core import state as state_lib
from jaxtrain.config import ConfigError, validate
from jaxtrain.core.lm import LanguageModel
from jaxtrain.train import calls
from tests.fixtures import tiny_config
from tests.train.test_comm_train import restored

COLUMNS = ("loss", "grad_norm", "param_norm", "update_norm", "lr")


def rows(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def step_rows(workdir):
  return {r["step"]: {k: r[k] for k in COLUMNS} for r in rows(workdir) if "loss" in r}


def assert_bitwise(cfg, calls_cfg, tmp_path):
  """Trains `cfg` one step a call and `calls_cfg` (the same with steps_per_call > 1); both end equal."""
  one, many = str(tmp_path / "one"), str(tmp_path / "many")
  jaxtrain.train(cfg, one, progress=False)
  jaxtrain.train(calls_cfg, many, progress=False)
  assert step_rows(many) == step_rows(one)  # floats from JSON: equal means bitwise equal float32 values
  assert len(step_rows(many)) == cfg.train.steps  # log_every=1: every step of every call has its row
  a, b = restored(cfg, one), restored(cfg, many)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
  jax.tree.map(np.testing.assert_array_equal, a.opt_state, b.opt_state)
  return one, many


def test_call_sizes_end_where_the_state_is_needed():
  cfg = tiny_config(train=dict(steps=20, steps_per_call=4), checkpoint=dict(every_steps=6, health_every_steps=0))
  every = calls.intervals(cfg)
  assert every == (6,)
  step, sizes = 0, []
  while step < cfg.train.steps:
    sizes.append(calls.size(step, cfg, every))
    step += sizes[-1]
  # 1-4 in a call, 5 and 6 singly (a save at 6), 7-10, 11 and 12 singly, 13-16, 17 and 18, 19 and 20 (the end)
  assert sizes == [4, 1, 1, 4, 1, 1, 4, 1, 1, 1, 1]
  assert calls.size(0, tiny_config(train=dict(steps=20)), every) == 1  # the default: one step a call


@pytest.mark.slow  # two runs and three compiles
def test_calls_are_bitwise_single_steps_with_a_save_between(tmp_path):
  cfg = tiny_config(train=dict(steps=10), checkpoint=dict(every_steps=6))
  calls_cfg = tiny_config(train=dict(steps=10, steps_per_call=4), checkpoint=dict(every_steps=6))
  _, many = assert_bitwise(cfg, calls_cfg, tmp_path)
  saved = [r["step"] for r in rows(many) if r.get("event") == "checkpoint_save"]
  assert saved == [6, 10]


def test_a_call_is_bitwise_its_steps_one_call_each():
  """The programs alone (no loop): 4 steps of tiny on 8 devices, one call each and in one call of 4."""
  cfg = tiny_config(train=dict(steps_per_call=4))
  mesh, task, tx, schedule = builder.build(cfg, "")
  feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
  source = task.batches("train", feed.lo, feed.hi)
  rows = [next(source) for _ in range(4)]
  with parallel.activate(mesh, cfg.mesh.rules):
    one, shardings = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
    step = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)[0]
    losses = []
    for row in rows:
      one, step_metrics = step(one, feed.put(row))
      losses.append(float(step_metrics["loss"]))
    many = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)[0]
    call = builder.compile_call(cfg, mesh, task, tx, schedule, shardings)
    many, call_metrics = call(many, feed.put_many(rows))
  assert np.asarray(call_metrics["loss"]).tolist() == losses
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(one.params), jax.device_get(many.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(one.opt_state), jax.device_get(many.opt_state))


@pytest.mark.slow  # three runs; the programs' own bitwise test above runs by default
def test_a_run_resumed_in_calls_equals_the_uninterrupted_run_of_single_steps(tmp_path):
  cfg = tiny_config(train=dict(steps=10), checkpoint=dict(every_steps=6))
  calls_cfg = tiny_config(train=dict(steps=10, steps_per_call=3), checkpoint=dict(every_steps=6))
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  jaxtrain.train(cfg, straight, progress=False)
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "10"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(calls_cfg, resumed, progress=False)  # from step 6: a call of 7-9, then 10 alone
  assert step_rows(resumed) == {s: r for s, r in step_rows(straight).items() if s > 6}
  a, b = restored(cfg, straight), restored(cfg, resumed)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
  jax.tree.map(np.testing.assert_array_equal, a.opt_state, b.opt_state)


# Bitwise as XLA optimizes both programs, as a run compiles them: unoptimized (tests/conftest.py),
# the lr logged at step 5, the first of the second call's scan, came out an ulp from the single
# call's (0.0072220745 vs 0.0072220755); every other column agreed.
@pytest.mark.optimized
@pytest.mark.slow  # two DiLoCo runs, each compiling a call of 4 replicas' inner steps
def test_streaming_diloco_calls_are_bitwise_single_steps(tmp_path):
  # H=4 in 2 fragments, each landing a step late, int8 outer syncs: a call of 4 steps holds two fragment syncs
  # and one in flight across the call's end
  sections = dict(mesh=dict(replica=4, data=2), checkpoint=dict(every_steps=0, health_every_steps=0),
                  diloco=dict(inner_steps=4, fragments=2, delay=1, format="int8"))
  cfg = tiny_config(train=dict(steps=9, batch_size=16), **sections)
  calls_cfg = tiny_config(train=dict(steps=9, batch_size=16, steps_per_call=4), **sections)
  one, many = assert_bitwise(cfg, calls_cfg, tmp_path)
  first = next(r for r in rows(many) if "loss" in r)
  assert first["comm_bytes_replica"] == next(r for r in rows(one) if "loss" in r)["comm_bytes_replica"] > 0


class Rollouts(LanguageModel):
  """A task that builds its batch from the params (as RL does)."""

  def make_batch(self, params, extra, task_state, batch, step):
    return batch


def test_tasks_that_build_batches_from_the_params_are_refused(tmp_path):
  cfg = tiny_config(train=dict(steps_per_call=2))
  with pytest.raises(ConfigError, match=r"train.steps_per_call=2: the task Rollouts builds each step's batch"):
    jaxtrain.train(cfg, str(tmp_path), task=Rollouts(cfg, str(tmp_path)), progress=False)
  for task in ("grpo", "ppo"):
    with pytest.raises(ConfigError, match=rf"{task} samples each step's rollouts"):
      validate(tiny_config(train=dict(steps_per_call=2, task=task)), 8)
  with pytest.raises(ConfigError, match=r"train.steps_per_call must be positive"):
    validate(tiny_config(train=dict(steps_per_call=0)), 8)


def test_calls_traced_at_their_positions_start_at_multiples_of_their_length():
  # streaming DiLoCo (period 4 / 2 = 2, delay 1) in calls of 4: traced step by step, from multiples of 4 only
  cfg = tiny_config(train=dict(steps=20, steps_per_call=4), mesh=dict(replica=4, data=2),
                    checkpoint=dict(every_steps=6, health_every_steps=0),
                    diloco=dict(inner_steps=4, fragments=2, delay=1))
  assert builder.overlapped(cfg)
  step, sizes = 0, []
  while step < cfg.train.steps:
    sizes.append(calls.size(step, cfg, calls.intervals(cfg)))
    step += sizes[-1]
  # 1-4, then 5 and 6 singly (a save at 6), 7 and 8 singly (up to the next multiple of 4), 9-12 (a save at its
  # last step), 13-16, 17 and 18 singly (a save at 18), 19 and 20 (the run ends before a whole call)
  assert sizes == [4, 1, 1, 1, 1, 4, 4, 1, 1, 1, 1]
  assert not builder.overlapped(tiny_config(train=dict(steps_per_call=3), diloco=dict(inner_steps=4, fragments=2,
                                                                                      delay=1)))
