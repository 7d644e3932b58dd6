"""Multi-process == one process: two `jax.distributed` processes on this machine (gloo CPU
collectives, 4 devices each) train the tiny config to the losses of one 8-device process with the
same global mesh and batch, each process feeding only its own rows of every global batch. Also with
the replica axis spanning the two processes: DiLoCo, and the compressed gradient reduction, whose
collectives over replica then run between the processes, reach the one process's losses and params.

The runs are subprocesses of tests/multiprocess_worker.py: a process's device count and its
distributed client are fixed at jax start-up, so they cannot live in the pytest process.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxtrain import metrics
from jaxtrain.checkpoint import pretrained

from tests.fixtures import ROOT
WORKER = os.path.join(ROOT, "tests", "train", "multiprocess_worker.py")
TIMEOUT_S = 300  # per run; 2 shared cores compile three jax programs side by side
RTOL = 1e-5


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def worker_env() -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT
  return env


class Run:
  """`num_processes` workers training in one workdir; each one's stdout+stderr goes to a log file.
  `overrides`: config changes ({section: {key: value}}; see the worker)."""

  def __init__(self, workdir, num_processes: int, devices_per_process: int, overrides: dict | None = None):
    self.workdir, self.procs, self.logs = str(workdir), [], []
    os.makedirs(self.workdir, exist_ok=True)
    port = free_port()
    for i in range(num_processes):
      log = os.path.join(self.workdir, f"worker_{i}.log")
      cmd = [sys.executable, WORKER, f"--process_id={i}", f"--num_processes={num_processes}", f"--port={port}",
             f"--workdir={self.workdir}", f"--devices_per_process={devices_per_process}",
             f"--overrides={json.dumps(overrides or {})}"]
      with open(log, "w") as f:
        self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=worker_env(), cwd=ROOT))
      self.logs.append(log)

  def failed(self) -> bool:
    return any(p.poll() not in (None, 0) for p in self.procs)

  def done(self) -> bool:
    return all(p.poll() == 0 for p in self.procs)

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def report(self, why: str) -> str:
    lines = [f"{self.workdir}: {why}"]
    for p, log in zip(self.procs, self.logs):
      with open(log, errors="replace") as f:
        text = "".join(line for line in f if "[SPMD]" not in line)  # XLA's remat warnings drown the error
      lines.append(f"--- {os.path.basename(log)} (exit {p.poll()}) ---\n{text[-4000:]}")
    return "\n".join(lines)


def wait_all(runs, timeout_s: float):
  """Waits for every run; on a failure or the timeout kills them all and fails with the logs' tails."""
  deadline = time.monotonic() + timeout_s
  try:
    while not all(r.done() for r in runs):
      bad = [r for r in runs if r.failed()]
      if bad or time.monotonic() > deadline:
        why = "a worker failed" if bad else f"timed out after {timeout_s:.0f} s"
        for r in runs:
          r.kill()
        pytest.fail("\n".join(r.report(why) for r in (bad or runs)), pytrace=False)
      time.sleep(0.5)
  finally:
    for r in runs:
      r.kill()


def by_step(rows, key):
  return {r["step"]: r[key] for r in rows if key in r}


def assert_close(got: dict, want: dict, what: str):
  assert sorted(got) == sorted(want), f"{what}: steps {sorted(got)} != {sorted(want)}"
  for step in want:
    rel = abs(got[step] - want[step]) / max(abs(want[step]), 1e-12)
    assert rel < RTOL, f"{what} at step {step}: {got[step]} vs one process {want[step]} (rel diff {rel:.2e})"


def reports(run: Run) -> list[dict]:
  """Each worker's process_I.json."""
  out = []
  for i in range(len(run.procs)):
    with open(os.path.join(run.workdir, f"process_{i}.json")) as f:
      out.append(json.load(f))
  return out


def saved_params(workdir: str) -> tuple[int, dict]:
  """(step, {path: numpy}) of the params in a workdir's newest checkpoint."""
  mngr, step = pretrained.find_step(workdir)
  params = pretrained.restore_params(mngr, step, pretrained.params_metadata(mngr, step))
  return step, {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


# A wire format's rounding turns the runs' float noise (~1e-7, as in the losses) into an occasional
# flip of one quantum: int8 of an outer gradient or update of up to ~2e-2 per block is ~1.6e-4, times
# DiLoCo's outer_lr * (1 + momentum) = 1.33. Those few elements may differ by up to that, no more
# (measured: DiLoCo 3 of 20640 params, 4.2e-5 at most; int8 + ef 61, 2.9e-5).
FLIP_ATOL, MAX_FLIPS = 5e-4, 0.01  # the bound, and the largest fraction of elements beyond RTOL/1e-6


def assert_params_close(got: dict, want: dict, what: str) -> tuple[float, int]:
  """Params equal to RTOL (atol 1e-6) except a few rounding flips; returns (max abs diff, flips)."""
  assert sorted(got) == sorted(want), what
  flips, worst, size = 0, 0.0, 0
  for k in want:
    assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, (what, k)
    diff = np.abs(got[k].astype(np.float64) - want[k])
    flips += int((~np.isclose(got[k], want[k], rtol=RTOL, atol=1e-6)).sum())
    worst, size = max(worst, float(diff.max())), size + diff.size
  assert worst < FLIP_ATOL and flips <= MAX_FLIPS * size, f"{what}: max abs diff {worst:.2e}, {flips}/{size} flips"
  return worst, flips


def train_like_one(tmp_path, overrides: dict):
  """One 8-device process and two 4-device ones train `overrides` on a replica=2 x data=4 mesh whose
  replica axis is the process axis; asserts the same losses per step and final params. Returns what it
  measured, printed by the callers (-s shows it)."""
  mesh = {"mesh": dict(replica=2, data=4)}
  one = Run(tmp_path / "one_process", 1, 8, {**mesh, **overrides})
  two = Run(tmp_path / "two_processes", 2, 4, {**mesh, **overrides})
  wait_all([one, two], TIMEOUT_S)

  (ref,), (p0, p1) = reports(one), reports(two)
  # make_mesh lays jax.devices() (process 0's first) out in mesh order: replica r is process r.
  assert ref["replica_processes"] == [[0], [0]]
  assert p0["replica_processes"] == p1["replica_processes"] == [[0], [1]]
  assert p0["final"]["comm_bytes_replica"] > 0  # the step does send over replica, i.e. between the processes

  want, got = metrics.read_metrics(one.workdir), metrics.read_metrics(two.workdir)
  assert [r["step"] for r in got if "loss" in r] == list(range(1, 9))
  measured = {}
  for key in ("loss", "eval_loss"):
    w, g = by_step(want, key), by_step(got, key)
    assert_close(g, w, key)
    measured[f"max rel diff {key}"] = max(abs(g[s] - w[s]) / abs(w[s]) for s in w)
  for key in ("loss", "eval_loss"):
    assert_close({0: p1["final"][key]}, {0: p0["final"][key]}, f"process 1 final {key}")

  (step_one, params_one), (step_two, params_two) = saved_params(one.workdir), saved_params(two.workdir)
  assert step_one == step_two == 8
  measured["params max abs diff"], measured["params flips"] = assert_params_close(params_two, params_one, "params")
  return measured


@pytest.mark.slow  # 145-165 s on 2 loaded cores (test_two_processes_train_like_one: 131 s on them)
@pytest.mark.long  # a scheme's variant of test_two_processes_train_like_one: out of CI's hour
def test_diloco_int8_over_two_processes_trains_like_one(tmp_path):
  # H=2 over 8 steps: 4 syncs, each an int8 all-to-all and all-gather between the two processes.
  print(train_like_one(tmp_path, {"diloco": dict(inner_steps=2, format="int8")}))


@pytest.mark.slow  # 145-165 s on 2 loaded cores (test_two_processes_train_like_one: 131 s on them)
@pytest.mark.long  # a scheme's variant of test_two_processes_train_like_one: out of CI's hour
def test_int8_reduction_with_error_feedback_over_two_processes_trains_like_one(tmp_path):
  print(train_like_one(tmp_path, {"comm": dict(format="int8", error_feedback="ef")}))


CONFIG = """
from tests.fixtures import tiny_config
from tests.train.multiprocess_worker import MESH, TRAIN


def get_config(arg=None):
  return tiny_config(train={**TRAIN, **%r}, mesh=MESH)
"""


def config_file(tmp_path, **train) -> str:
  """A config file for the CLI: the workers' tiny run, with `train` changes."""
  path = tmp_path / "tiny_mp.py"
  path.write_text(CONFIG % train)
  return str(path)


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


@pytest.mark.slow  # 80-115 s on 2 shared cores: three jax processes compile the same step
def test_two_processes_train_like_one(tmp_path):
  # The reference and the pair start together: they are independent, and the wall time is their max.
  one = Run(tmp_path / "one_process", num_processes=1, devices_per_process=8)
  two = Run(tmp_path / "two_processes", num_processes=2, devices_per_process=4)
  wait_all([one, two], TIMEOUT_S)

  reports = {}
  for run in (one, two):
    for i in range(len(run.procs)):
      with open(os.path.join(run.workdir, f"process_{i}.json")) as f:
        reports[run, i] = json.load(f)
  ref, p0, p1 = reports[one, 0], reports[two, 0], reports[two, 1]
  assert (ref["process_count"], ref["global_devices"]) == (1, 8)
  assert [(p["process_index"], p["process_count"], p["local_devices"], p["global_devices"]) for p in (p0, p1)] \
      == [(0, 2, 4, 8), (1, 2, 4, 8)]

  # Each process built only its own rows of every global batch; together exactly the whole batch.
  batch_size = ref["batch_size"]
  for split in ("train", "eval"):
    assert ref["rows"][split] == [0, batch_size]
    (lo0, hi0), (lo1, hi1) = sorted([p0["rows"][split], p1["rows"][split]])
    assert lo0 == 0 and hi0 == lo1 and hi1 == batch_size and hi0 - lo0 == hi1 - lo1, (split, p0["rows"], p1["rows"])

  # Same losses per step; only process 0 wrote metrics.jsonl (one row per step, no duplicates).
  want, got = metrics.read_metrics(one.workdir), metrics.read_metrics(two.workdir)
  steps = [r["step"] for r in got if "loss" in r]
  assert steps == list(range(1, len(steps) + 1)) and len(steps) == 8, steps
  assert sorted(by_step(got, "eval_loss")) == [4, 8]
  for key in ("loss", "eval_loss"):
    assert_close(by_step(got, key), by_step(want, key), key)
  # Process 1 computed the same (replicated) final metrics as process 0.
  for key in ("loss", "eval_loss"):
    assert_close({0: p1["final"][key]}, {0: p0["final"][key]}, f"process 1 final {key}")


@pytest.mark.slow  # 80-120 s on 2 shared cores
def test_a_save_that_fails_on_process_0_alone_fails_on_both_and_training_goes_on(tmp_path):
  """Orbax makes a step's directory on process 0 alone, between two barriers: when that failed, process 1
  waited 300 s at the second one while process 0 trained on into a collective process 1 never joined (and
  their barrier counters stayed out of step for every later save). Process 0's probe, agreed by both, fails
  the save on both; the next saves succeed and the run ends on time."""
  disk = tmp_path / "disk"
  os.makedirs(disk)
  overrides = {"train": dict(eval_every=0), "checkpoint": dict(dir=str(disk / "ckpt"), every_steps=2)}
  os.environ["JT_BREAK_SAVES"] = "4"
  try:
    two = Run(tmp_path / "run", num_processes=2, devices_per_process=4, overrides=overrides)
  finally:
    del os.environ["JT_BREAK_SAVES"]
  wait_all([two], TIMEOUT_S)
  rows = metrics.read_metrics(two.workdir)
  errors = [r for r in rows if r.get("event") == "checkpoint_error"]
  assert [r["step"] for r in errors] == [4] and "Not a directory" in errors[0]["error"], errors
  assert [r["step"] for r in rows if r.get("event") == "checkpoint_save"] == [2, 6, 8]
  assert sorted(int(d) for d in os.listdir(disk / "ckpt") if d.isdigit()) == [6, 8]  # keep=2
  assert [f["final"]["step"] for f in reports(two)] == [8, 8]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step_with_a_checkpoint(tmp_path):
  os.environ["JT_STEPS"] = "100000"
  try:
    two = Run(tmp_path, num_processes=2, devices_per_process=4)
  finally:
    del os.environ["JT_STEPS"]
  path = os.path.join(two.workdir, "metrics.jsonl")
  deadline = time.monotonic() + TIMEOUT_S
  while time.monotonic() < deadline and not two.failed() and not (
      os.path.exists(path) and len(metrics.read_metrics(two.workdir)) >= 3):
    time.sleep(0.5)
  two.procs[1].send_signal(signal.SIGTERM)  # only process 1 is told
  wait_all([two], TIMEOUT_S)
  finals = []
  for i in range(2):
    with open(os.path.join(two.workdir, f"process_{i}.json")) as f:
      finals.append(json.load(f)["final"])
  assert [f["preempted"] for f in finals] == ["SIGTERM", "SIGTERM"], finals
  assert finals[0]["step"] == finals[1]["step"] < 100000
  steps = [int(d) for d in os.listdir(os.path.join(two.workdir, "checkpoints")) if d.isdigit()]
  assert max(steps) == finals[0]["step"]


PEER_TIMEOUT_S = 15.0
INTERVAL_S = PEER_TIMEOUT_S / 10  # jaxtrain.train.peers: a heartbeat written and read every tenth of the timeout


@pytest.mark.slow  # 100-250 s on 2 shared cores: two pairs of CLI processes compile side by side
def test_a_lost_peer_ends_the_survivor_with_one_line_and_status_6(tmp_path):
  # Pair 0 loses process 1, which jaxtrain's heartbeats find; pair 1 loses process 0, the coordinator, whose
  # death jax's client answers at once with an abort (it was status 134 and a C++ stack, ~70 s after the loss).
  config = config_file(tmp_path, steps=100000, eval_every=0)
  extra = [f"--config.train.peer_timeout_s={PEER_TIMEOUT_S}"]
  pairs = [Cli(tmp_path / f"pair_{victim}", config, ["flags", "flags"], 4, extra) for victim in (1, 0)]
  deadline = time.monotonic() + TIMEOUT_S
  training = lambda c: len([r for r in metrics.read_metrics(c.workdir) if "loss" in r]) >= 2  # noqa: E731
  waiting = list(pairs)
  killed = {}
  while waiting:
    if time.monotonic() > deadline or any(c.failed() for c in waiting):
      for c in pairs:
        c.kill()
      pytest.fail("\n".join(c.report("did not reach training") for c in waiting), pytrace=False)
    for c, victim in zip(pairs, (1, 0)):
      if c in waiting and os.path.exists(os.path.join(c.workdir, "metrics.jsonl")) and training(c):
        c.procs[victim].kill()  # SIGKILL mid-training: nothing of it runs any more
        killed[victim] = (c, time.monotonic())
        waiting.remove(c)
    time.sleep(0.2)
  try:
    for victim, (c, t_kill) in sorted(killed.items()):
      survivor = c.procs[1 - victim]
      try:
        survivor.wait(timeout=PEER_TIMEOUT_S + 60)
      except subprocess.TimeoutExpired:
        pytest.fail(c.report(f"victim {victim}: the survivor still runs"), pytrace=False)
      elapsed = time.monotonic() - t_kill
      last = c.stderr(1 - victim).strip().splitlines()[-1]
      assert survivor.returncode == 6, c.report(f"survivor exit {survivor.returncode}")
      pid = c.procs[victim].pid
      assert re.fullmatch(rf"error: lost process {victim} of 2 \(pid {pid} on {re.escape(socket.gethostname())}\)"
                          r": .+", last), last
      # The bound: silence for the timeout plus one interval each for the last beat read and the verdict,
      # plus a few seconds for this test's own polling on loaded cores.
      assert elapsed < PEER_TIMEOUT_S + 2 * INTERVAL_S + 5, (victim, elapsed, last)
      print(f"victim {victim}: survivor ended after {elapsed:.1f} s: {last}")
  finally:
    for c in pairs:
      c.kill()


# ~100-150 s on 2 shared cores: three jax processes compile the step and the scorer
@pytest.mark.slow
def test_in_loop_tasks_over_two_processes_score_like_one(tmp_path):
  """eval.tasks in the loop of a two-process run: the scoring and the generation are collective
  over both processes' devices, process 0 alone writes the rows, and every eval/<task>/<metric>
  equals the one-process run's (both run eval at steps 4 and 8). A resumed run asks process 0
  which steps it logged (eval/loop.logged_steps), so both processes skip the same evaluations."""
  path = tmp_path / "copy.jsonl"
  docs = [{"task": {"kind": "multiple_choice"}}]
  docs += [{"context": f"< {a} {b} {c} |", "choices": [f" {a} {b} {c} >", f" {c} {b} {a} >"],
            "gold": 0} for a, b, c in ((1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12), (3, 1, 2))]
  path.write_text("".join(json.dumps(d) + "\n" for d in docs))
  gen = tmp_path / "gen.jsonl"  # generation through the KV-cache sampler, rows over the processes
  gen.write_text("".join(json.dumps(d) + "\n" for d in [
      {"task": {"kind": "generate", "max_new_tokens": 4, "until": [">"]}},
      *({"context": f"< {a} {b} |", "answer": f"{a} {b}"} for a, b in ((1, 2), (5, 6), (9, 3)))]))
  overrides = {"eval": {"tasks": f"{path},{gen}", "every_steps": 4}}
  one = Run(tmp_path / "one_process", 1, 8, overrides)
  two = Run(tmp_path / "two_processes", 2, 4, overrides)
  wait_all([one, two], TIMEOUT_S)
  want, got = metrics.read_metrics(one.workdir), metrics.read_metrics(two.workdir)
  columns = ["eval/copy/acc", "eval/copy/acc_norm", "eval/gen/exact_match"]
  for key in columns:
    assert sorted(by_step(want, key)) == [4, 8], (key, want)
    assert by_step(got, key) == by_step(want, key), key
  stderr = "eval/copy/acc_stderr"
  assert_close(by_step(got, stderr), by_step(want, stderr), "stderr")
