"""A soak: a multi-process run under `python -m jaxtrain launch`, with faults drawn at random, against
an uninterrupted run of the same config; hours of faults compressed into a wall time.

  python tools/soak.py [--minutes 60] [--processes 2] [--seed 0] [--workdir DIR] [--report FILE]

experiments/soak/config.py (configs/tiny.py's model and data), each process on 4 CPU devices. A
short calibration run measures the step rate; the
reference (uninterrupted, under launch) then gets about a third of the wall time, the faulted run the
rest. Faults, drawn (seeded) at exponential intervals, every kind in turn in a shuffled order:

  kill9       SIGKILL to one train process
  kill9_save  SIGKILL to one train process while a checkpoint is being written (a tmp directory of
              the step exists)
  sigterm     SIGTERM to one train process: every process saves and stops at one step (status 3),
              launch exits 3, and the soak starts launch again, as a scheduler's requeue would
  readonly    the checkpoint directory made immutable (chattr +i) for fewer than
              checkpoint.max_failed_saves saves: the failed saves are counted, the run goes on
  nan         a NaN-poisoned batch (train.nan_steps, drawn before the start: the reference meets
              it too): its update is skipped
  lost_peer   SIGSTOP to one train process for 1.5 x train.peer_timeout_s: the others exit 6,
              launch restarts them all

The report (markdown, printed and written to --report): faults by kind and whether the run survived
them, checkpoint restores succeeded / attempted, steps lost and recomputed, goodput, each process's
largest RSS against the uninterrupted run's (a stated bound: a leak across faults and restarts would
exceed it), the longest stretch without a new step (a stated bound: a hang that the next fault
happened to end would exceed it), and whether the final parameters equal the reference's bitwise.
Exit status 0 when every check holds, 1 otherwise.
"""

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.soak.config import EVERY, PEER_TIMEOUT_S  # noqa: E402

KINDS = ("kill9", "kill9_save", "sigterm", "readonly", "nan", "lost_peer")
RSS_BOUND = 1.25  # a faulted run's process: its largest RSS over the uninterrupted run's largest
# the longest the faulted run may go without a new step row: a lost peer (1.5 x the peer timeout
# stopped, the timeout to notice) plus a restart; a hang (a save that left a process in a barrier
# for Orbax's 300 s) is far beyond it
STALL_BOUND_S = 90.0


def train_flags(steps: int, nan_steps: list[int]) -> list[str]:
  return ["--config=experiments/soak/config.py", f"--config.train.steps={steps}",
          f"--config.train.nan_steps={','.join(map(str, nan_steps))}", "--no_sample"]


def env() -> dict:
  out = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                      "JAX_LOCAL_DEVICE_IDS")}
  return {**out, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}


def launch(workdir: str, processes: int, flags: list[str], log) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "jaxtrain", "launch", f"--processes={processes}",
         "--devices_per_process=4", "--max_restarts=1000", "--", "train", f"--workdir={workdir}",
         *flags]
  return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:  # a line being written
        pass
  return out


def pids(workdir: str) -> list[int]:
  starts = [r for r in read_jsonl(os.path.join(workdir, "launch.jsonl")) if r["event"] == "start"]
  return starts[-1]["pids"] if starts else []


def last_step(workdir: str) -> int:
  steps = [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step" in r]
  return max(steps, default=0)


def sample_rss(workdir: str, into: dict) -> None:
  """Appends (time, RSS) of each process `launch` started last in `workdir` to into[pid]."""
  import psutil
  now = time.monotonic()
  for pid in pids(workdir):
    try:
      into.setdefault(pid, []).append((now, psutil.Process(pid).memory_info().rss))
    except psutil.Error:
      pass


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


class Soak:
  """The faulted run: its launcher (started again after a status 3), the faults, RSS samples."""

  def __init__(self, workdir, processes, flags, log, rng):
    self.workdir, self.processes, self.flags, self.log, self.rng = workdir, processes, flags, log, rng
    self.proc = launch(workdir, processes, flags, log)
    self.requeues, self.faults, self.rss = 0, [], {}
    self.ckpt_dir = os.path.join(workdir, "checkpoints")
    self.step, self.moved, self.stall = 0, time.monotonic(), (0.0, 0)  # (seconds, at step)

  def watch(self) -> int:
    """The newest logged step; keeps the longest stretch without a new one."""
    step, now = last_step(self.workdir), time.monotonic()
    if step != self.step:
      self.step, self.moved = step, now
    self.stall = max(self.stall, (now - self.moved, step))
    return step

  def poll(self) -> int | None:
    """The launcher's exit status when the run has ended (a status 3 starts it again)."""
    code = self.proc.poll()
    if code == 3:
      self.requeues += 1
      self.proc = launch(self.workdir, self.processes, self.flags, self.log)
      return None
    return code

  def victim(self) -> int | None:
    live = [p for p in pids(self.workdir) if alive(p)]
    return self.rng.choice(live) if len(live) == self.processes else None

  def inject(self, kind: str, step_s: float) -> dict:
    """One fault of `kind`; what happened, or why it was not injected."""
    pid = self.victim()
    if pid is None:
      return {"kind": kind, "injected": False, "why": "processes not all up"}
    row = {"kind": kind, "injected": True, "step": last_step(self.workdir), "pid": pid}
    if kind == "kill9":
      os.kill(pid, signal.SIGKILL)
    elif kind == "kill9_save":
      deadline = time.monotonic() + 3 * EVERY * step_s + 30
      while time.monotonic() < deadline:
        if os.path.isdir(self.ckpt_dir) and any("tmp" in n for n in os.listdir(self.ckpt_dir)):
          os.kill(pid, signal.SIGKILL)
          return row
        time.sleep(0.005)
      os.kill(pid, signal.SIGKILL)
      row["mid_save"] = False
    elif kind == "sigterm":
      os.kill(pid, signal.SIGTERM)
    elif kind == "lost_peer":
      os.kill(pid, signal.SIGSTOP)
      time.sleep(1.5 * PEER_TIMEOUT_S)
      if alive(pid):
        os.kill(pid, signal.SIGCONT)
    elif kind == "readonly":
      seconds = 1.5 * EVERY * step_s  # at most two saves fail (checkpoint.max_failed_saves is 3)
      made = subprocess.run(["chattr", "+i", self.ckpt_dir], capture_output=True, text=True)
      if made.returncode:
        return {"kind": kind, "injected": False, "why": f"chattr: {made.stderr.strip()}"}
      time.sleep(seconds)
      subprocess.run(["chattr", "-i", self.ckpt_dir], check=True)
      row["seconds"] = round(seconds, 1)
    return row


def calibrate(tmp: str, processes: int, log) -> float:
  """Seconds per step of the launched run after its compile (30 steps, the rows' step times)."""
  workdir = os.path.join(tmp, "calibration")
  proc = launch(workdir, processes, train_flags(30, []), log)
  if proc.wait() != 0:
    raise SystemExit(f"calibration run failed with status {proc.returncode}; see the log")
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step_time_s" in r]
  shutil.rmtree(workdir)
  return statistics.median(r["step_time_s"] for r in rows[1:])  # the first holds the compile


def params_equal(a: str, b: str) -> bool:
  import jax
  import numpy as np

  from jaxtrain.checkpoint import pretrained
  (_, x), (_, y) = pretrained.load_params(a), pretrained.load_params(b)
  return all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def report(args, steps, step_s, soak, status, ref_s, run_s, equal, ref_rss) -> tuple[str, bool]:
  rows = read_jsonl(os.path.join(soak.workdir, "metrics.jsonl"))
  launches = read_jsonl(os.path.join(soak.workdir, "launch.jsonl"))
  restores = [r for r in rows if r.get("event") == "checkpoint_restore"]
  # a relaunch with a complete checkpoint on disk restores it: every restart that found one, and every
  # requeue after a status 3 (which saved first)
  attempted = soak.requeues + sum(r["event"] == "restart" and r.get("resume_step") is not None
                                  for r in launches)
  final = next((r for r in reversed(rows) if "lost_steps" in r), {})
  injected = [f for f in soak.faults if f["injected"]]
  by_kind = {k: sum(f["kind"] == k for f in injected) for k in KINDS}
  skipped = {f["kind"]: f["why"] for f in soak.faults if not f["injected"]}
  ref_peak = max((r for samples in ref_rss.values() for _, r in samples), default=0)
  peaks = [(pid, len(samples), max(r for _, r in samples)) for pid, samples in soak.rss.items()]
  rss_ok = ref_peak > 0 and all(peak <= RSS_BOUND * ref_peak for _, _, peak in peaks)
  stall_ok = soak.stall[0] <= STALL_BOUND_S
  ok = (status == 0 and equal and len(restores) == attempted and rss_ok and stall_ok
        and all(by_kind.values()))
  mib = lambda n: f"{n / 2**20:.0f}"
  lines = [
      f"# Soak report ({datetime.date.today().isoformat()})", "",
      f"`python tools/soak.py --minutes {args.minutes} --processes {args.processes} --seed "
      f"{args.seed}`: experiments/soak/config.py, {args.processes} processes x 4 CPU devices under `launch`, "
      f"{steps} steps (checkpoint every {EVERY}, peer timeout {PEER_TIMEOUT_S:.0f} s); host "
      f"{os.cpu_count()} CPUs. Calibrated step time {step_s:.2f} s. Uninterrupted reference "
      f"{ref_s / 60:.1f} min, faulted run {run_s / 60:.1f} min.", "",
      "| fault | injected |", "| --- | ---: |",
      *[f"| {k} | {by_kind[k]} |" for k in KINDS], "",
      *([f"Not injected: {', '.join(f'{k} ({w})' for k, w in skipped.items())}.", ""]
        if skipped else []),
      f"- The faulted run ended with status {status} ({'survived every fault' if status == 0 else 'NOT survived'}); "
      f"launch restarts {sum(r['event'] == 'restart' for r in launches)}, requeues after status 3 "
      f"{soak.requeues}.",
      f"- Checkpoint restores: {len(restores)} succeeded of {attempted} attempted.",
      f"- Steps lost and recomputed: {final.get('lost_steps', 'n/a')}; goodput "
      f"{final.get('goodput', float('nan')):.3f} of {final.get('goodput_wall_s', float('nan')):.0f} s "
      f"(restarts counted by goodput: {final.get('restarts', 'n/a')}).",
      f"- RSS, sampled every 0.5 s (bound: every process's largest <= {RSS_BOUND}x the largest of the "
      f"uninterrupted run's processes, {mib(ref_peak)} MiB): "
      + "; ".join(f"pid {p} {mib(peak)} MiB ({peak / max(ref_peak, 1):.2f}x, {n} samples)"
                  for p, n, peak in peaks) + f" -> {'within' if rss_ok else 'OVER'} the bound.",
      f"- Longest stretch without a new step row (rows every 10 steps): {soak.stall[0]:.0f} s, after "
      f"step {soak.stall[1]} (bound {STALL_BOUND_S:.0f} s) -> {'within' if stall_ok else 'OVER'} the bound.",
      f"- Final parameters {'equal' if equal else 'DIFFER from'} the uninterrupted run's, bitwise.", "",
      f"Overall: {'PASS' if ok else 'FAIL'}.", "",
      "Faults in order (step: the newest logged step when injected):", "",
      *[f"- {f['kind']}" + (f" at step {f['step']}" if f["injected"] else f": not injected ({f['why']})")
        + (" (no save seen: killed after waiting)" if f.get("mid_save") is False else "")
        for f in soak.faults]]
  return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--minutes", type=float, default=60.0)
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--workdir", default=None, help="default: a temporary directory, removed after")
  p.add_argument("--report", default=None, help="also write the report here")
  args = p.parse_args(argv)
  rng = random.Random(args.seed)
  tmp = args.workdir or tempfile.mkdtemp(prefix="soak_")
  os.makedirs(tmp, exist_ok=True)
  log = open(os.path.join(tmp, "soak.log"), "a")
  try:
    step_s = calibrate(tmp, args.processes, log)
    budget_s = args.minutes * 60
    steps = max(4 * EVERY, int(budget_s / 3 / step_s) // EVERY * EVERY)
    nan_steps = sorted(rng.sample(range(EVERY + 1, steps - EVERY), 2))
    flags = train_flags(steps, nan_steps)
    start = time.monotonic()
    reference, ref_rss = launch(os.path.join(tmp, "reference"), args.processes, flags, log), {}
    while reference.poll() is None:
      sample_rss(os.path.join(tmp, "reference"), ref_rss)
      time.sleep(0.5)
    if reference.returncode != 0:
      raise SystemExit(f"the uninterrupted run failed with status {reference.returncode}")
    ref_s = time.monotonic() - start
    kinds = [k for k in KINDS if k != "nan"]
    order = []
    start = time.monotonic()
    soak = Soak(os.path.join(tmp, "run"), args.processes, flags, log, rng)
    soak.faults += [{"kind": "nan", "injected": True, "step": s} for s in nan_steps]
    # faults over the run's expected length, its restarts included: at least one of each kind
    gap_s = max(20.0, (budget_s - ref_s) * 0.6 / (2 * len(kinds)))
    due, status = time.monotonic() + rng.expovariate(1 / gap_s), None
    while status is None:
      status = soak.poll()
      sample_rss(soak.workdir, soak.rss)
      step = soak.watch()
      if status is None and time.monotonic() >= due and step < steps - 3 * EVERY:
        if not order:
          order = rng.sample(kinds, len(kinds))
        soak.faults.append(soak.inject(order.pop(), step_s))
        due = time.monotonic() + rng.expovariate(1 / gap_s)
      time.sleep(0.5)
    run_s = time.monotonic() - start
    equal = status == 0 and params_equal(os.path.join(tmp, "reference"), soak.workdir)
    text, ok = report(args, steps, step_s, soak, status, ref_s, run_s, equal, ref_rss)
  finally:
    log.close()
    if args.workdir is None:
      shutil.rmtree(tmp, ignore_errors=True)
  print(text, end="")
  if args.report:
    with open(args.report, "w") as f:
      f.write(text)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
