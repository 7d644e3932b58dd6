"""The CLI's multi-process path: `train --distributed` configured by flags or JAX_* variables (flags win), a
missing or bad piece as one line with status 2, and two CLI processes that train like one."""

import os
import subprocess
import sys

import pytest

from jaxtrain import config as config_lib, metrics
from jaxtrain.__main__ import distributed_options, parse
from tests.fixtures import ROOT
from tests.train.test_multiprocess import TIMEOUT_S, Cli, assert_close, by_step, config_file, wait_all

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


def test_a_missing_piece_is_one_line_exit_2(tmp_path):
  # The help promised these variables; jax 0.10 reads only the address from the environment and raised
  # "Number of processes must be defined" from inside jax. A real process: jax joins before its backend starts.
  env = {**os.environ, **ENV, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": "localhost:1"}
  del env["JAX_NUM_PROCESSES"]
  p = subprocess.run([sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py",
                      f"--workdir={tmp_path}/w", "--distributed"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert p.returncode == 2 and p.stderr.splitlines() == [
      "error: --distributed: --num_processes (or JAX_NUM_PROCESSES) not given, and no cluster (Slurm, Open MPI, "
      "TPU) was detected to supply it"], p.stderr[-3000:]


@pytest.mark.slow  # 80-190 s on 2 shared cores: three jax processes compile the same step side by side
def test_two_cli_processes_train_like_one(tmp_path):
  config = config_file(tmp_path)
  one = Cli(tmp_path / "one", config, [None], devices_per_process=8)
  two = Cli(tmp_path / "two", config, ["flags", "env"], devices_per_process=4)  # process 1: JAX_* variables
  wait_all([one, two], TIMEOUT_S)
  want, got = metrics.read_metrics(one.workdir), metrics.read_metrics(two.workdir)
  assert [r["step"] for r in got if "loss" in r] == list(range(1, 9))
  for key in ("loss", "eval_loss"):
    assert_close(by_step(got, key), by_step(want, key), key)
