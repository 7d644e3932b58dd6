"""Checkpoint tiers, save policies, workdir compatibility and crash safety (kill -9)."""

import contextlib
import glob
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import checkpoint, metrics
from jaxtrain.checkpoint.policy import AdaptivePolicy
from jaxtrain.config import ConfigError
from jaxtrain import builder
from jaxtrain.train import workdir as workdir_lib
from tests.fixtures import tiny_config

from tests.fixtures import ROOT


def losses(workdir) -> dict[int, list[float]]:
  """Every logged loss by step (a step re-run after a restart is logged again)."""
  out = {}
  for r in metrics.read_metrics(workdir):
    if "loss" in r:
      out.setdefault(r["step"], []).append(r["loss"])
  return out


def final_params(workdir):
  cfg = workdir_lib.load_config(workdir)
  cfg.mesh.update(data=-1, fsdp=1, tensor=1, rules="fsdp")
  mesh, task, tx, _ = builder.build(cfg, workdir)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, read_only=True)
  state = builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  return int(state.step), jax.device_get(state.params)


@pytest.mark.slow  # ~20 s of training and saving; keeps the default suite under 10 minutes
def test_tiers_newest_complete_step_wins_and_the_persistent_tier_survives(tmp_path):
  def cfg(fast):
    return tiny_config(train=dict(steps=6, eval_every=0),
                       checkpoint=dict(every_steps=3, keep=3, fast_dir=fast, fast_every_steps=2, fast_keep=2))
  straight = str(tmp_path / "straight")
  one = dict(devices=jax.devices()[:1], progress=False, sync_every_step=True)
  jaxtrain.train(cfg(str(tmp_path / "straight_fast")), straight, **one)
  want = losses(straight)
  assert sorted(os.listdir(tmp_path / "straight_fast")) == ["2", "4"]  # 6 is the end: persistent only
  assert sorted(os.listdir(os.path.join(straight, "checkpoints"))) == ["3", "6"]
  saves = [r for r in metrics.read_metrics(straight) if r.get("event") == "checkpoint_save"]
  assert [(r["step"], r["tier"]) for r in saves] == [(2, "fast"), (3, "persistent"), (4, "fast"),
                                                     (6, "persistent")]
  assert all(r["save_bytes"] > 0 and r["save_blocking_s"] >= 0 and r["save_MBps"] > 0 for r in saves)

  # Both tiers hold steps: the newest complete one (fast, 4) wins over persistent 3.
  run, fast = str(tmp_path / "run"), str(tmp_path / "run_fast")
  shutil.copytree(straight, run)
  shutil.copytree(tmp_path / "straight_fast", fast)
  shutil.rmtree(os.path.join(run, "checkpoints", "6"))
  os.remove(os.path.join(run, "metrics.jsonl"))
  jaxtrain.train(cfg(fast), run, **one)
  rows = metrics.read_metrics(run)
  restore = [r for r in rows if r.get("event") == "checkpoint_restore"]
  assert [(r["step"], r["tier"]) for r in restore] == [(4, "fast")] and restore[0]["restore_MBps"] > 0
  assert losses(run) == {5: want[5], 6: want[6]}

  # The fast tier is lost (another machine): the persistent tier restores, the run ends the same.
  shutil.rmtree(fast)
  shutil.rmtree(os.path.join(run, "checkpoints", "6"))
  os.remove(os.path.join(run, "metrics.jsonl"))
  jaxtrain.train(cfg(fast), run, **one)
  restore = [r for r in metrics.read_metrics(run) if r.get("event") == "checkpoint_restore"]
  assert [(r["step"], r["tier"]) for r in restore] == [(3, "persistent")]
  assert losses(run) == {4: want[4], 5: want[5], 6: want[6]}
  jax.tree.map(np.testing.assert_array_equal, final_params(straight)[1], final_params(run)[1])


@pytest.mark.slow  # ~50 s on 2 cores (five short trainings); kept out of the default suite's 10 minutes
def test_an_incompatible_workdir_is_refused_unless_starting_over(tmp_path):
  workdir, one = str(tmp_path / "run"), dict(devices=jax.devices()[:1], progress=False, sync_every_step=True)
  jaxtrain.train(tiny_config(train=dict(steps=2, eval_every=0)), workdir, **one)
  # another run can start from these params (checkpoint.init_from): same values, its own shardings
  trained = final_params(workdir)[1]
  fresh_cfg = tiny_config(mesh=dict(data=1, fsdp=2))
  mesh, task, tx, _ = builder.build(fresh_cfg, "", jax.devices()[:2])
  from jaxtrain.core import state as state_lib
  fresh, _ = state_lib.create_state(task, tx, 1, mesh, "fsdp")
  started = builder.init_params(workdir, fresh.params)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(started), trained)
  jax.tree.map(lambda a, b: a.sharding == b.sharding or pytest.fail("sharding"), started, fresh.params)
  with pytest.raises(ConfigError, match=r"init_from=.*embed'\] is shape \(64, 32\), the model needs \(64, 48\)"):
    wide = tiny_config(model=dict(d_model=48))
    mesh, task, tx, _ = builder.build(wide, "", jax.devices()[:1])
    builder.init_params(workdir, state_lib.create_state(task, tx, 1, mesh, "fsdp")[0].params)
  with pytest.raises(ConfigError, match=r"another config \(model.d_model: 32 -> 64\).*--start_over"):
    jaxtrain.train(tiny_config(train=dict(steps=2, eval_every=0), model=dict(d_model=64)), workdir, **one)
  # longer training, other checkpoint settings: the same run, resumed (another mesh: tests/test_elastic.py)
  more = tiny_config(train=dict(steps=3, eval_every=0), checkpoint=dict(keep=5))
  jaxtrain.train(more, workdir, **one)
  assert sorted(losses(workdir)) == [1, 2, 3]
  # start over: the old checkpoints and logs are gone, training begins at step 1
  other = tiny_config(train=dict(steps=2, eval_every=0), model=dict(d_model=64))
  jaxtrain.train(other, workdir, start_over=True, **one)
  assert sorted(losses(workdir)) == [1, 2] and os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
  # a run started from another's params trains (the CLI flag --config.checkpoint.init_from=DIR)
  tuned = str(tmp_path / "tuned")
  jaxtrain.train(tiny_config(train=dict(steps=2, eval_every=0), model=dict(d_model=64),
                             checkpoint=dict(init_from=workdir)), tuned, **one)
  assert sorted(losses(tuned)) == [1, 2]


def test_adaptive_policy_saves_often_while_unstable_and_rarely_while_calm():
  p = AdaptivePolicy(min_steps=2, max_steps=16, spike=0.1)
  decisions = []
  for step in range(1, 20):  # a smoothly falling loss: every save doubles the interval
    assert p.observe(step, 5.0 - 0.01 * step, 1.0, 0) is None
    decisions.append(p.saved(step))
  assert p.interval == 16 and [d for d in decisions if d][:2] == [
      "interval -> 4 steps (calm since the last save)", "interval -> 8 steps (calm since the last save)"]
  assert "loss spike at step 20" in p.observe(20, 9.0, 1.0, 0) and p.interval == 2
  assert p.saved(20) is None and p.interval == 2  # not calm since the last save: no growth yet
  assert p.observe(21, 4.8, 10.0, 0) is None  # a warning, but already at the shortest interval
  p.interval = 8
  assert "grad-norm spike" in p.observe(22, 4.8, 50.0, 0) and p.interval == 2
  p.interval = 8
  assert "update skipped" in p.observe(23, 4.8, 1.0, 1) and p.interval == 2
  p.interval = 8
  assert "non-finite loss" in p.observe(24, float("nan"), 1.0, 1) and p.interval == 2


def test_the_step_saved_before_a_spike_is_kept_and_is_the_latest_good_one(tmp_path):
  """keep=1 alone would delete it; the adaptive policy marks it good (calm before it and at the step after it)."""
  cfg = tiny_config(checkpoint=dict(adaptive=True, adaptive_min_steps=2, adaptive_max_steps=2, keep=1))
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, str(tmp_path))
  tree = lambda step: {"w": jnp.arange(4.0) + step}  # noqa: E731
  listed = lambda: sorted(ckpts.tiers[0].manager.all_steps())  # noqa: E731
  for step in range(1, 15):
    loss = 9.0 if step == 9 else 5.0 - 0.01 * step  # a spike at step 9: the state saved at 8 made it
    ckpts.observe(step, loss, 1.0, 0)
    if ckpts.due(step):
      ckpts.save(step, tree(step), {}, {})
      ckpts.wait()
    if step == 7:  # 6 is good once step 7 was calm; until the next save, 4 (the good one then) stays too
      assert listed() == [4, 6] and ckpts.latest_good() == 6
    if step == 11:
      assert listed() == [6, 10] and ckpts.latest_good() == 6  # 8 preceded the spike, 10 followed it
  assert listed() == [12, 14] and ckpts.latest_good() == 12  # calm again: 12 is good and 6 is let go
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
  state = ckpts.restore(abstract, {"w": sharding}, ckpts.latest_good())[0]
  np.testing.assert_array_equal(state["w"], tree(12)["w"])
  ckpts.close()
  plain = checkpoint.Checkpoints(tiny_config().checkpoint, str(tmp_path / "plain"))
  assert plain.latest_good() is None  # no adaptive policy: nothing tells calm from unstable
  plain.close()


@contextlib.contextmanager
def stderr_logging():
  """Logging to stderr from INFO up, as outside pytest: absl's first log call (at Orbax's import) runs
  logging.basicConfig() when the root logger has no handler, but under pytest it has pytest's."""
  root, handler = logging.getLogger(), logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
  level = root.level
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  try:
    yield
  finally:
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.mark.slow  # ~35 s on 2 cores: the default suite stays under 10 minutes
def test_train_resume_and_restore_log_nothing_from_dependencies(tmp_path, capfd):
  one = dict(devices=jax.devices()[:1], progress=False, sync_every_step=True)
  workdir = str(tmp_path / "run")
  with stderr_logging():
    jaxtrain.train(tiny_config(train=dict(steps=2, eval_every=0)), workdir, **one)
    jaxtrain.train(tiny_config(train=dict(steps=3, eval_every=0)), workdir, **one)  # the read-only probe, a restore
  err = capfd.readouterr().err
  assert not re.search(r"^(\w+:(absl|orbax)|[IWEF]\d{4} )", err, re.M), err[-3000:]


# ---- crash safety: kill -9 at random moments, some while a save is in flight ----

def command(workdir, steps=60):
  return [sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
          f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.train.batch_size=8", "--config.train.seq_len=32", "--config.model.d_model=32",
          "--config.model.d_ff=64", "--config.optim.warmup_steps=1", f"--config.checkpoint.fast_dir={workdir}/fast",
          "--config.checkpoint.fast_every_steps=2", "--config.checkpoint.every_steps=5", "--no_sample"]


def in_flight(workdir) -> set:
  """The unfinished (temporary) step directories of both tiers."""
  return set(glob.glob(f"{workdir}/fast/*tmp*") + glob.glob(f"{workdir}/checkpoints/*tmp*"))


def kill_randomly(workdir, kills: int, seed: int) -> int:
  """Starts the run again and again, each time SIGKILLed: even tries a random moment after the try's first
  logged step, odd tries the instant one of its own saves is seen in flight (from a random moment after
  that step). Finally lets it finish. Returns how many kills hit a save in flight.

  The moments count from the try's first step, not from its start: a start (imports, restore, compile) takes
  seconds, and more or less of them on another machine or with a warm compilation cache; counted from the
  start, a fast machine finished all 60 steps within the first tries and the rest killed nothing."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = ROOT
  metrics = os.path.join(workdir, "metrics.jsonl")
  logged = lambda: os.path.getsize(metrics) if os.path.exists(metrics) else 0
  rng, mid_save = random.Random(seed), 0
  for attempt in range(kills):
    stale = in_flight(workdir)  # left by the previous kill; the new run removes them when it starts
    before = logged()
    proc = subprocess.Popen(command(workdir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up = time.time() + 120
    while proc.poll() is None and logged() == before and time.time() < give_up:  # this try's first step
      time.sleep(0.002)
    if attempt % 2:
      earliest = time.time() + rng.uniform(0.0, 0.5)
      while proc.poll() is None and time.time() < give_up:
        if time.time() >= earliest and in_flight(workdir) - stale:
          break
        time.sleep(0.002)
    else:
      deadline = time.time() + rng.uniform(0.0, 1.0)
      while time.time() < deadline and proc.poll() is None:
        time.sleep(0.002)
    mid_save += bool(in_flight(workdir) - stale)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  done = subprocess.run(command(workdir), env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return mid_save


def crash_test(tmp_path, kills, seed):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = ROOT
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  done = subprocess.run(command(straight), env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  mid_save = kill_randomly(killed, kills, seed)
  want, got = losses(straight), losses(killed)
  assert sorted(got) == sorted(want) == list(range(1, 61))
  for step, values in got.items():  # every logged loss, re-runs after restarts included, is the same
    assert set(values) == set(want[step]), step
  step_a, params_a = final_params(str(straight))
  step_b, params_b = final_params(str(killed))
  assert step_a == step_b == 60
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)
  assert not in_flight(killed)  # unfinished steps were cleaned up
  return mid_save


@pytest.mark.slow
def test_kill_9_many_times_some_mid_save_never_loses_the_newest_complete_checkpoint(tmp_path):
  mid_save = crash_test(tmp_path, kills=12, seed=1)
  assert mid_save >= 4, f"only {mid_save} kills hit a save in flight"
