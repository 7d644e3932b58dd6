"""Out of memory ends a run with one line naming the planner's advice and exit status 7; with
train.batch_size=auto it first retries once with twice the microbatches. The memory runs out for
real: a child process under an address-space limit (tests/train/oom_child.py), whose allocations the
kernel refuses. Process tests (they start a CLI run each)."""

import json
import os
import subprocess
import sys

import pytest

from jaxtrain import config_files, errors
from jaxtrain.plan import oom

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "train", "oom_child.py")


def run_child(tmp_path, when: str, budget_gib: float, *overrides: str):
  env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_ARENA_MAX": "2", "XLA_FLAGS": "",
         "JAX_PLATFORMS": "cpu"}
  args = [sys.executable, CHILD, when, str(budget_gib), "train",
          f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'run'}", "--no_sample",
          "--config.train.steps=1", "--config.optim.warmup_steps=0", "--config.train.eval_every=0",
          *overrides]
  return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def error_lines(done) -> list[str]:
  """stderr without the progress bar's redraws."""
  lines = done.stderr.replace("\r", "\n").splitlines()
  return [line for line in lines if line.strip() and "it/s]" not in line and "?it/s" not in line]


def test_a_host_short_of_memory_at_start_gets_the_planners_line(tmp_path):
  """1 GiB left and a step the planner puts at ~5.5 GiB: refused before anything is allocated."""
  done = run_child(tmp_path, "start", 1.0, "--config.train.batch_size=1024")
  assert done.returncode == errors.OutOfMemory.exit_status, done.stderr[-2000:]
  lines = error_lines(done)
  assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert lines[0].startswith("error: out of memory: the step needs ~5.")
  assert "available; would fit with: train.microbatches=" in lines[0]


@pytest.mark.slow
def test_xla_running_out_while_the_step_runs_is_one_line_and_status_7(tmp_path):
  """The start-up check passes, then the memory is taken: XLA's RESOURCE_EXHAUSTED at the step's
  1.4 GB buffer becomes the line."""
  done = run_child(tmp_path, "after_check", 0.9, "--config.train.batch_size=256")
  assert done.returncode == errors.OutOfMemory.exit_status, done.stderr[-2000:]
  lines = error_lines(done)
  assert "Traceback" not in done.stderr, done.stderr[-2000:]
  assert lines[-1].startswith("error: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating")
  assert "would fit with: train.microbatches=" in lines[-1]


@pytest.mark.slow
def test_auto_batch_retries_once_with_twice_the_microbatches(tmp_path):
  """train.batch_size=auto picks 268 for 1.6 GiB; its step cannot get 1.4 GB, so the run retries with
  2 microbatches (an oom_retry row) and finishes."""
  done = run_child(tmp_path, "after_check", 1.2, "--config.train.batch_size=auto",
                   "--config.train.device_memory_gib=1.6")
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  events = {r["event"]: r for r in rows if "event" in r}
  assert events["auto_batch"]["microbatches"] == 1
  retry = events["oom_retry"]
  assert retry["microbatches"] == 2 and retry["batch_size"] == events["auto_batch"]["batch_size"]
  assert "RESOURCE_EXHAUSTED" in retry["error"]
  assert json.load(open(tmp_path / "run" / "config.json"))["train"]["microbatches"] == 2
  assert any(r.get("step") == 1 and "loss" in r for r in rows)


def test_the_advice_names_the_planners_changes():
  """Over the limit: the changes that fit it; predicted to fit yet refused: what fits half."""
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  cfg.train.batch_size = 256
  over = oom.advice(cfg, 1, "cpu", 0.5 * 2**30)
  assert over.startswith("the planner predicts ~") and "train.microbatches=4" in over
  within = oom.advice(cfg, 1, "cpu", 64 * 2**30, need=False)
  assert within.startswith("would fit with: train.microbatches=")


def test_only_failed_allocations_count_as_out_of_memory():
  assert oom.is_out_of_memory(MemoryError())
  assert oom.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."))
  assert not oom.is_out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes\nRESOURCE_EXHAUSTED"))
  assert oom.host_available() > 0
