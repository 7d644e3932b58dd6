"""Restarts: the train step comes from the workdir's persistent compilation cache (nothing compiled
again) and a resumed run writes its `restart` row, whose parts add up to the time from the process's
creation to its first step. The subprocess test is a process test (two CLI runs)."""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import pytest

from jaxtrain.train import restart

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["--config.train.steps=4", "--config.checkpoint.every_steps=2", "--config.train.log_every=1",
       "--config.train.eval_every=0", "--config.optim.warmup_steps=0", "--no_sample"]


def cli(workdir, *extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
         and k != "JAX_COMPILATION_CACHE_DIR"}  # the run's own default: WORKDIR/jax_cache
  env.update(PYTHONPATH=ROOT, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  args = [sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py",
          f"--workdir={workdir}", *RUN, *extra]
  done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.slow
def test_a_restart_compiles_nothing_and_writes_its_restart_row(tmp_path):
  """A run to step 4 (checkpoints at 2 and 4); its step-4 checkpoint is lost and the same command
  runs again: the step is a cache hit, no program is compiled before the first step, and the row's
  parts add up."""
  workdir = str(tmp_path / "run")
  first = cli(workdir)
  assert not [r for r in first if r.get("event") == "restart"]  # a fresh run is no restart
  assert any(name.startswith("jit_train_step-") for name in os.listdir(f"{workdir}/jax_cache"))
  shutil.rmtree(f"{workdir}/checkpoints/4")
  rows = cli(workdir)
  (row,) = [r for r in rows if r.get("event") == "restart"]
  assert row["step"] == 3 and row["compilation_cache"] == f"{workdir}/jax_cache"
  assert row["restart_cache_hits"] >= 1 and row["restart_cache_misses"] == 0
  parts = sum(row[f"restart_{p}_s"] for p in restart.PARTS)
  assert abs(parts - row["restart_total_s"]) < 1e-6 and all(
      row[f"restart_{p}_s"] >= 0 for p in restart.PARTS)
  assert row["restart_imports_s"] > 0.1 and row["restart_first_step_s"] > 0


def test_the_setting_picks_the_cache_directory(tmp_path):
  """'' leaves jax's setting, "workdir" keeps a directory the caller chose (the test run's), a path
  replaces it; the cache then writes there."""
  before = jax.config.jax_compilation_cache_dir
  try:
    assert restart.use_compilation_cache("", str(tmp_path)) == before
    if before:
      assert restart.use_compilation_cache("workdir", str(tmp_path)) == before
    path = restart.use_compilation_cache(str(tmp_path / "cache"), str(tmp_path))
    assert path == str(tmp_path / "cache") and jax.config.jax_compilation_cache_dir == path
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(lambda x: x * 3 + time.time_ns() % 7)(jax.numpy.arange(5)).block_until_ready()
    assert os.listdir(path)
  finally:
    restart.use_compilation_cache(before or "", str(tmp_path))
    if not before:
      jax.config.update("jax_compilation_cache_dir", None)
      from jax.experimental.compilation_cache import compilation_cache
      compilation_cache.reset_cache()


def test_startup_parts_run_from_the_process_creation():
  startup = restart.Startup()
  assert 0 < startup.seconds["imports"] < time.time() - restart.process_start() + 1
  startup.charge("compile")
  row = startup.row()
  assert row["event"] == "restart"
  assert row["restart_total_s"] == pytest.approx(sum(startup.seconds.values()))
