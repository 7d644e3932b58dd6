import pytest
"""SIGTERM saves and exits with status 3; rerunning the same command continues from that step."""

import os
import signal
import subprocess
import sys
import time

from jaxtrain import metrics
from jaxtrain.train.preemption import EXIT_STATUS

from tests.fixtures import ROOT


def command(workdir):
  return [sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
          "--config.train.steps=2000", "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.train.batch_size=4", "--config.train.seq_len=32", "--config.model.d_model=32",
          "--config.model.d_ff=64", "--config.optim.warmup_steps=1", "--no_sample"]


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_sigterm_saves_exits_3_and_the_rerun_resumes(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = ROOT
  proc = subprocess.Popen(command(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  path = tmp_path / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= 5):
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == EXIT_STATUS, err[-2000:]
  assert "preempted (SIGTERM)" in err
  stopped = [r for r in metrics.read_metrics(str(tmp_path)) if "loss" in r][-1]["step"]
  assert 5 <= stopped < 2000
  assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())[-1] == stopped

  # the rerun continues from that step (a short run: stop at stopped + 3)
  rerun = command(tmp_path)
  rerun[rerun.index("--config.train.steps=2000")] = f"--config.train.steps={stopped + 3}"
  done = subprocess.run(rerun, env=env, capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-2000:]
  steps = [r["step"] for r in metrics.read_metrics(str(tmp_path)) if "loss" in r]
  assert steps[-3:] == [stopped + 1, stopped + 2, stopped + 3] and steps.count(stopped + 1) == 1
