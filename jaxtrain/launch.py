"""`python -m jaxtrain launch --processes N [--max_restarts K] [--min_processes M]
[--devices_per_process D] -- train --config=... --workdir=DIR ...`: the N processes of a
multi-process run on this host, restarted without a person. No jax import: it only manages
subprocesses.

Each attempt starts N `python -m jaxtrain train ... --distributed` processes, each in its own process
group, told where to meet by JAX_COORDINATOR_ADDRESS (a free port of this host, new each attempt),
JAX_NUM_PROCESSES and JAX_PROCESS_ID, and JAXTRAIN_RESTART_COUNT (0 at first, as torchrun's
TORCHELASTIC_RESTART_COUNT); with --devices_per_process, process i of the attempt gets its device
slot's D devices (JAX_LOCAL_DEVICE_IDS on GPUs, D forced host devices on CPU). Then:

- every process exits 0: done, status 0;
- the first failure (the *culprit*: the first process seen to exit non-zero other than 6, since
  the survivors of a lost peer exit 6, a signal first among those seen together, SIGABRT last of
  the signals (a survivor's failed collective aborts); else the first seen) decides:
  2 (bad input), 4 (diverged), 5 (checkpoints unwritable): a restart would fail alike; the others
  are given GRACE_S to end by themselves, then killed, and launch exits with that status;
  3 (preempted, saved): the others stop at the same step; launch waits and exits 3;
  anything else (a signal such as SIGKILL, 6, 1 an uncaught exception, 134 an abort): the others
  are killed at once (SIGKILL: their collectives wait on the lost process, so they could not save),
  and all start again; `train` resumes from the newest complete checkpoint in its workdir. After
  --max_restarts restarts launch exits with the culprit's status (128 + N for signal N).
- The same device slot culprit in two attempts in a row, while more than --min_processes run: the
  slot is dropped and the run restarts on one process fewer (elastic restore: the checkpoint
  restores on any device count, the data order continues; the config's mesh and batch must fit
  the fewer devices, else that attempt ends with status 2 and launch with it).
- SIGTERM or SIGINT to launch (a scheduler's preemption) is passed to every process, which save and
  stop at one step (status 3); launch waits and exits 3.

Every start, restart and the end are rows of WORKDIR/launch.jsonl, and each restart one line on
stderr: the attempt, its statuses, the culprit, the seconds from the fault to the relaunch, and the
newest complete checkpoint step on disk at the relaunch (the step the run resumes from).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from jaxtrain import config as config_lib

ROWS = "launch.jsonl"
FINAL = (2, 4, 5)  # a restart would end the same way
PREEMPTED, PEER_LOST = 3, 6
GRACE_S = 10.0  # for the others to end by themselves after a final status
STOP_WAIT_S = 600.0  # for every process to save and stop after launch is told to stop
POLL_S = 0.1
SHRINK_AFTER = 2  # attempts in a row with the same culprit slot
# `train` flags that launch sets itself
OWN_FLAGS = ("--distributed", "--coordinator_address", "--num_processes", "--process_id",
             "--local_device_ids")


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    raise config_lib.ConfigError(f"launch: {message}")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """launch's options and the `train ...` command after `--`; bad ones are one ConfigError line."""
  cut = argv.index("--") if "--" in argv else len(argv)
  parser = _Parser(prog="python -m jaxtrain launch", description=__doc__.split("\n\n", 1)[1],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, required=True, metavar="N")
  parser.add_argument("--max_restarts", type=int, default=3, metavar="K",
                      help="restarts before giving up (default 3)")
  parser.add_argument("--min_processes", type=int, default=None, metavar="M",
                      help="drop a process that keeps failing, down to M (default N: never)")
  parser.add_argument("--devices_per_process", type=int, default=None, metavar="D",
                      help="process i gets devices i*D..i*D+D-1 (GPUs), or D CPU devices")
  args = parser.parse_args(argv[:cut])  # --help prints and exits here
  command = argv[cut + 1:]
  if cut == len(argv):
    raise config_lib.ConfigError("launch: expected `launch --processes N [...] -- train ...`")
  if args.min_processes is None:
    args.min_processes = args.processes
  if args.processes < 1 or not 1 <= args.min_processes <= args.processes:
    raise config_lib.ConfigError(
        f"launch: need 1 <= --min_processes ({args.min_processes}) <= --processes "
        f"({args.processes})")
  if args.max_restarts < 0:
    raise config_lib.ConfigError(f"launch: --max_restarts={args.max_restarts} must be >= 0")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    raise config_lib.ConfigError(
        f"launch: --devices_per_process={args.devices_per_process} must be >= 1")
  if not command or command[0] != "train":
    raise config_lib.ConfigError("launch: the command after -- must be `train ...`")
  own = [a for a in command if a.split("=")[0] in OWN_FLAGS]
  if own:
    raise config_lib.ConfigError(f"launch: {own[0]} is launch's to set; leave it out of train")
  workdir(command)
  return args, command


def workdir(command: list[str]) -> str:
  """The --workdir of a `train ...` command."""
  for i, arg in enumerate(command):
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
    if arg == "--workdir" and i + 1 < len(command):
      return command[i + 1]
  raise config_lib.ConfigError("launch: train needs --workdir=DIR")


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def newest_checkpoint(directory: str) -> int | None:
  """The newest complete checkpoint step on disk in the workdir's local tiers (checkpoint.dir and
  fast_dir of its config.json, else WORKDIR/checkpoints), as checkpoint.manager.tier_dirs names
  them; None when there is none."""
  dirs = [os.path.join(directory, "checkpoints")]
  try:
    with open(os.path.join(directory, "config.json")) as f:
      k = json.load(f).get("checkpoint", {})
    dirs = [d for d in (k.get("fast_dir"), k.get("dir") or dirs[0]) if d and "://" not in d]
  except (OSError, ValueError):
    pass
  steps = []
  for d in dirs:
    try:
      steps += [int(name) for name in os.listdir(d) if name.isdigit()]  # Orbax's complete steps
    except OSError:
      continue
  return max(steps, default=None)


def exit_status(status: int) -> int:
  """A Popen returncode as a shell reports it: a signal N is 128 + N."""
  return 128 - status if status < 0 else status


def describe(status: int) -> str:
  if status < 0:
    try:
      return f"killed by {signal.Signals(-status).name}"
    except ValueError:
      return f"killed by signal {-status}"
  return f"exit {status}"


class Attempt:
  """One start of the run: a process per slot, each in its own process group."""

  def __init__(self, number: int, command: list[str], slots: list[int], devices: int | None):
    self.number, self.slots, self.port = number, slots, free_port()
    self.procs, self.failures = [], []  # failures: (index, status, seen at), in the order seen
    n = len(slots)
    for i, slot in enumerate(slots):
      env = dict(os.environ, JAXTRAIN_RESTART_COUNT=str(number - 1))
      cmd = [sys.executable, "-m", "jaxtrain", *command]
      if n > 1:
        cmd.append("--distributed")
        env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{self.port}", JAX_NUM_PROCESSES=str(n),
                   JAX_PROCESS_ID=str(i))
      if devices is not None:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(slot * devices + d) for d in range(devices))
        env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                            f"--xla_force_host_platform_device_count={devices}").strip()
      self.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))

  def poll(self) -> list:
    statuses = [p.poll() for p in self.procs]
    seen = {i for i, _, _ in self.failures}
    new = [i for i, s in enumerate(statuses) if s not in (None, 0) and i not in seen]
    # seen together: one killed by a signal came first (a survivor's collective then failed), and
    # a SIGABRT is what a survivor's failed collective raises (gloo: "Received data size doesn't
    # match"), so it comes after any other signal
    for i in sorted(new, key=lambda i: (statuses[i] >= 0, statuses[i] == -signal.SIGABRT)):
      self.failures.append((i, statuses[i], time.monotonic()))
    return statuses

  def culprit(self) -> tuple[int, int, float] | None:
    """(index, status, seen at) of the process that failed first, survivors of a loss aside."""
    if not self.failures:
      return None
    return next((f for f in self.failures if f[1] != PEER_LOST), self.failures[0])

  def signal(self, sig: int, group: bool = True):
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig) if group else p.send_signal(sig)
        except (ProcessLookupError, PermissionError):
          pass

  def wait(self, timeout_s: float) -> list:
    """Waits up to `timeout_s` for every process, then kills what is left; the statuses."""
    deadline = time.monotonic() + timeout_s
    while any(s is None for s in self.poll()) and time.monotonic() < deadline:
      time.sleep(POLL_S)
    self.signal(signal.SIGKILL)
    for p in self.procs:
      p.wait()
    return self.poll()


class Launcher:
  """The attempts of one run, their rows and the decisions between them."""

  def __init__(self, args: argparse.Namespace, command: list[str]):
    self.args, self.command = args, command
    self.workdir = workdir(command)
    self.slots = list(range(args.processes))
    self.restarts, self.stop = 0, None
    self.culprits = []  # the culprit slot of each failed attempt, in order

  def row(self, row: dict):
    os.makedirs(self.workdir, exist_ok=True)
    with open(os.path.join(self.workdir, ROWS), "a") as f:
      f.write(json.dumps({"time": time.time(), **row}) + "\n")

  def start(self, number: int) -> Attempt:
    return Attempt(number, self.command, self.slots, self.args.devices_per_process)

  def started(self, attempt: Attempt) -> Attempt:
    self.row({"event": "start", "attempt": attempt.number, "processes": len(attempt.slots),
              "slots": attempt.slots, "pids": [p.pid for p in attempt.procs]})
    return attempt

  def _stop(self, signum, frame):
    del frame
    self.stop = signal.Signals(signum).name

  def run(self) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._stop)
    attempt = self.started(self.start(1))
    while True:
      statuses = attempt.poll()
      if self.stop:
        attempt.signal(signal.SIGTERM, group=False)  # each saves and stops at one step
        statuses = attempt.wait(STOP_WAIT_S)
        return self.end(attempt, statuses, 0 if all(s == 0 for s in statuses) else PREEMPTED)
      if all(s == 0 for s in statuses):
        return self.end(attempt, statuses, 0)
      culprit = attempt.culprit()
      if culprit is None:
        time.sleep(POLL_S)
        continue
      index, status, seen = culprit
      if status in FINAL or status == PREEMPTED:
        statuses = attempt.wait(STOP_WAIT_S if status == PREEMPTED else GRACE_S)
        return self.end(attempt, statuses, status)
      attempt.signal(signal.SIGKILL)
      statuses = attempt.wait(0)
      if self.restarts >= self.args.max_restarts:
        print(f"launch: attempt {attempt.number}: process {index} {describe(status)}; "
              f"{self.restarts} restarts already (--max_restarts), giving up", file=sys.stderr)
        return self.end(attempt, statuses, exit_status(status))
      attempt = self.restart(attempt, statuses, index, status, seen)

  def restart(self, attempt: Attempt, statuses: list, index: int, status: int,
              seen: float) -> Attempt:
    slot = attempt.slots[index]
    self.culprits.append(slot)
    dropped = None
    if (len(self.slots) > self.args.min_processes and len(self.culprits) >= SHRINK_AFTER
        and len(set(self.culprits[-SHRINK_AFTER:])) == 1):
      dropped = slot
      self.slots = [s for s in self.slots if s != slot]
      self.culprits = []
    self.restarts += 1
    resume = newest_checkpoint(self.workdir)
    nxt = self.start(attempt.number + 1)
    seconds = time.monotonic() - seen
    self.row({"event": "restart", "attempt": attempt.number, "statuses": statuses,
              "culprit": index, "culprit_slot": slot, "culprit_status": status,
              "dropped_slot": dropped, "processes": len(self.slots), "restarts": self.restarts,
              "fault_to_relaunch_s": seconds, "resume_step": resume})
    fewer = f", without slot {dropped}" if dropped is not None else ""
    print(f"launch: attempt {attempt.number}: process {index} {describe(status)}; restart "
          f"{self.restarts}/{self.args.max_restarts} on {len(self.slots)} processes{fewer} from "
          f"step {resume}, {seconds:.1f} s after the fault", file=sys.stderr)
    return self.started(nxt)

  def end(self, attempt: Attempt, statuses: list, status: int) -> int:
    self.row({"event": "end", "attempt": attempt.number, "statuses": statuses,
              "status": status, "restarts": self.restarts, "processes": len(self.slots)})
    return status


def main(argv: list[str]) -> int:
  """The CLI's `launch`: bad flags are one line and status 2; else the run's status."""
  try:
    args, command = parse(argv)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return Launcher(args, command).run()
