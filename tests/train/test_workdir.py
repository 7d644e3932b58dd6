"""The workdir through the CLI: a run is checked against its newest checkpoint's own config (config.json or not),
and one workdir holds one training run at a time (WORKDIR/.lock)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from jaxtrain import metrics
from jaxtrain.__main__ import main
from jaxtrain.config import ConfigError
from jaxtrain.train import lock
from tests.fixtures import ROOT

CONFIG = """
from tests.fixtures import tiny_config


def get_config(arg=None):
  return tiny_config(train=dict(steps={steps}, eval_every=0), checkpoint=dict(keep=5))
"""


def config_file(tmp_path, steps: int = 2) -> str:
  path = tmp_path / f"tiny_{steps}.py"
  path.write_text(CONFIG.format(steps=steps))
  return str(path)


def train(capsys, config: str, workdir: str, *overrides) -> tuple[int, list[str]]:
  """The CLI's exit status and its stderr lines (after clearing what earlier calls printed)."""
  capsys.readouterr()
  code = main(["train", f"--config={config}", f"--workdir={workdir}", "--no_sample", *overrides])
  return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.slow  # one short training (~20-70 s on 2 shared cores), then two refusals
def test_a_workdir_without_config_json_is_checked_against_its_newest_checkpoint(tmp_path, capsys):
  config, workdir = config_file(tmp_path), str(tmp_path / "run")
  assert train(capsys, config, workdir)[0] == 0
  os.remove(os.path.join(workdir, "config.json"))  # lost, or never copied with the checkpoints

  # Another seed would have resumed the old run silently: refused, one line naming the difference.
  code, err = train(capsys, config, workdir, "--config.train.seed=1")
  assert code == 2 and len(err) == 1, err
  assert err[0] == (f"error: {workdir} holds a run of another config (train.seed: 0 -> 1); rerun with --start_over "
                    "to replace it, or use another --workdir"), err
  # Another d_model: the same one line (not a traceback from the restore), and config.json not rewritten.
  code, err = train(capsys, config, workdir, "--config.model.d_model=64")
  assert code == 2 and len(err) == 1 and "(model.d_model: 32 -> 64)" in err[0], err
  assert not os.path.exists(os.path.join(workdir, "config.json"))
  assert [r["step"] for r in metrics.read_metrics(workdir) if "loss" in r] == [1, 2]  # nothing ran since


# ---- one run per workdir ----

HOLD = """import os, sys, time
from jaxtrain.train import lock
held = lock.Lock(sys.argv[1])
if sys.argv[2] == "orphan" and os.fork():  # the child keeps the flock, the holder itself is gone
  os._exit(0)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def hold_from_subprocess(workdir: str, how: str = "plain") -> subprocess.Popen:
  """A process holding `workdir`'s lock (`orphan`: a forked child of a holder that already exited)."""
  proc = subprocess.Popen([sys.executable, "-c", HOLD, workdir, how], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  proc.holder_pid = int(proc.stdout.readline() or 0)  # 0: the holder failed
  return proc


def refusal(workdir: str, pid: int) -> str:
  return (f"error: {workdir} is in use by another training run (pid {pid} on {socket.gethostname()}); wait for "
          "it to end or use another --workdir")


@pytest.mark.slow  # one short training (~20-70 s on 2 shared cores)
def test_a_workdir_in_use_is_refused_until_its_holder_dies(tmp_path, capsys):
  config, workdir = config_file(tmp_path), str(tmp_path / "run")
  holder = hold_from_subprocess(workdir)
  try:
    assert holder.holder_pid == holder.pid
    code, err = train(capsys, config, workdir)
    assert code == 2 and err == [refusal(workdir, holder.pid)], err
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    holder.kill()  # SIGKILL: nothing of the holder runs any more; the OS drops its flock
    holder.wait()
    code, err = train(capsys, config, workdir)
    assert code == 0, err
  finally:
    holder.kill()
    holder.wait()
  assert [r["step"] for r in metrics.read_metrics(workdir) if "loss" in r] == [1, 2]
  assert not os.path.exists(os.path.join(workdir, lock.NAME))  # released at the end of the run


def test_lock_refuses_a_live_holder_and_is_released_on_any_exit(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(RuntimeError, match="boom"):
    with lock.hold(workdir):
      with pytest.raises(ConfigError) as refused:
        lock.Lock(workdir)  # another open file description: flock refuses it, even in this process
      assert f"error: {refused.value}" == refusal(workdir, os.getpid())
      raise RuntimeError("boom")
  assert not os.path.exists(workdir)  # released: the lock file and the workdir it created are gone
  again = lock.Lock(workdir)
  with open(os.path.join(workdir, lock.NAME)) as f:
    assert f.read().split() == [str(os.getpid()), socket.gethostname()]
  again.release()


def test_a_stale_lock_is_taken_over(tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  with open(os.path.join(workdir, lock.NAME), "w") as f:  # a killed run's file: its flock went with it
    f.write(f"{int(dead.stdout)} {socket.gethostname()}\n")
  lock.Lock(workdir).release()
  # A flock that outlived its run (a forked child inherited it) while the pid in the file is gone: stale too.
  orphan = hold_from_subprocess(workdir, "orphan")
  try:
    assert orphan.holder_pid and orphan.wait() == 0  # the holder exited; its child still holds the flock
    taken = lock.Lock(workdir)
    with open(os.path.join(workdir, lock.NAME)) as f:
      assert f.read().split() == [str(os.getpid()), socket.gethostname()]
    taken.release()
  finally:
    if orphan.holder_pid:
      with contextlib.suppress(ProcessLookupError):
        os.kill(orphan.holder_pid, signal.SIGKILL)
