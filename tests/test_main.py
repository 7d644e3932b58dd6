"""The CLI's multi-process path: `train --distributed` configured by flags or JAX_* variables (flags win), a
missing or bad piece as one line with status 2, and two CLI processes that train like one."""

import os
import subprocess
import sys

import pytest

from jaxtrain import config as config_lib, metrics
from jaxtrain.__main__ import distributed_options, main, parse
from tests.fixtures import ROOT
from tests.train.test_multiprocess import TIMEOUT_S, assert_close, by_step, free_port, wait_all, worker_env

ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}


def options(argv, environ=None):
  args, _ = parse(["train", "--config=c.py", "--workdir=w", *argv])
  return distributed_options(args, environ or {})


def test_distributed_options_come_from_flags_else_the_environment():
  assert options(["--distributed"], ENV) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                             "process_id": 3}
  assert options(["--distributed", "--process_id=1", "--coordinator_address=h:5", "--local_device_ids=0,1"], ENV) \
      == {"coordinator_address": "h:5", "num_processes": 4, "process_id": 1, "local_device_ids": [0, 1]}
  assert options(["--distributed"]) == {}  # nothing given: jax's cluster auto-detection (Slurm, Open MPI, TPU)
  assert options([], ENV) is None  # without --distributed the variables are not read


@pytest.mark.parametrize("argv, environ, message", [
    (["--process_id=1"], {}, "--coordinator_address, --num_processes, --process_id and --local_device_ids need "
                             "--distributed"),
    (["--distributed", "--num_processes=2", "--process_id=2"], {}, "--process_id=2 must be in [0, 2)"),
    (["--distributed", "--num_processes=0"], {}, "--num_processes=0 must be positive"),
    (["--distributed"], {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two': expected an integer"),
    (["--distributed", "--coordinator_address=nohost"], {}, "--coordinator_address='nohost': expected HOST:PORT"),
    (["--distributed", "--local_device_ids=0,a"], {}, "--local_device_ids='0,a': expected integers like 0,1"),
])
def test_bad_distributed_options_are_one_line(argv, environ, message):
  with pytest.raises(config_lib.ConfigError) as e:
    options(argv, environ)
  assert str(e.value) == message


def test_a_missing_piece_is_one_line_exit_2(monkeypatch, capsys):
  # The help promised these variables; jax 0.10 needs all three (or a cluster it detects) and raised
  # "Number of processes must be defined" from inside jax.
  for name, value in {**ENV, "JAX_COORDINATOR_ADDRESS": "localhost:1"}.items():
    monkeypatch.setenv(name, value)
  monkeypatch.delenv("JAX_NUM_PROCESSES")
  code = main(["train", f"--config={ROOT}/configs/tiny.py", "--workdir=/nonexistent/w", "--distributed"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and err == ["error: --distributed: --num_processes (or JAX_NUM_PROCESSES) not given, and no "
                               "cluster (Slurm, Open MPI, TPU) was detected to supply it"], err


CONFIG = """
from tests.fixtures import tiny_config
from tests.train.multiprocess_worker import MESH, TRAIN


def get_config(arg=None):
  return tiny_config(train=TRAIN, mesh=MESH)
"""


class Cli:
  """`python -m jaxtrain train` processes in one workdir; `how[i]` configures process i: "flags", "env" or None
  (one process, no --distributed)."""

  def __init__(self, workdir, config: str, how: list, devices_per_process: int, extra=()):
    self.workdir, self.procs, self.logs = str(workdir), [], []
    os.makedirs(self.workdir)
    port = free_port()
    for i, kind in enumerate(how):
      env = dict(worker_env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
      cmd = [sys.executable, "-m", "jaxtrain", "train", f"--config={config}", f"--workdir={self.workdir}",
             "--no_sample", *extra]
      if kind == "flags":
        cmd += ["--distributed", f"--coordinator_address=localhost:{port}", f"--num_processes={len(how)}",
                f"--process_id={i}"]
      elif kind == "env":
        cmd += ["--distributed"]
        env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(len(how)), JAX_PROCESS_ID=str(i))
      self.logs.append(os.path.join(self.workdir, f"cli_{i}.log"))
      with open(self.logs[-1], "w") as out, open(self.logs[-1] + ".err", "w") as err:
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT))

  def failed(self) -> bool:
    return any(p.poll() not in (None, 0) for p in self.procs)

  def done(self) -> bool:
    return all(p.poll() == 0 for p in self.procs)

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def stderr(self, i: int) -> str:
    with open(self.logs[i] + ".err", errors="replace") as f:
      return "".join(line for line in f if "[SPMD]" not in line)  # XLA's remat warnings drown the rest

  def report(self, why: str) -> str:
    return "\n".join([f"{self.workdir}: {why}"] + [f"--- process {i} (exit {p.poll()}) ---\n{self.stderr(i)[-4000:]}"
                                                  for i, p in enumerate(self.procs)])


@pytest.mark.slow  # 80-120 s on 2 shared cores: three jax processes compile the same step side by side
def test_two_cli_processes_train_like_one(tmp_path):
  config = tmp_path / "tiny_mp.py"
  config.write_text(CONFIG)
  one = Cli(tmp_path / "one", str(config), [None], devices_per_process=8)
  two = Cli(tmp_path / "two", str(config), ["flags", "env"], devices_per_process=4)  # process 1: JAX_* variables
  wait_all([one, two], TIMEOUT_S)
  want, got = metrics.read_metrics(one.workdir), metrics.read_metrics(two.workdir)
  assert [r["step"] for r in got if "loss" in r] == list(range(1, 9))
  for key in ("loss", "eval_loss"):
    assert_close(by_step(got, key), by_step(want, key), key)
