"""Fault to first step: how long a restarted run takes from its process's creation to its first step.

A run trains to step S (checkpoints at S/2 and S); its step-S checkpoint is lost (removed) and the
same command runs again, resuming from S/2. Each mode restarts the same copy of that workdir, in
turn, `--repeats` times (medians; the same path each time: jax's cache key holds the cache's path):

  base   the code of `--base` (a checkout of an earlier commit), if given
  off    this code with train.compilation_cache="" (nothing kept between processes but the peak)
  cache  this code as it ships: the step loaded from WORKDIR/jax_cache

`first step` is timed from outside for every mode (process start to the first resumed step's row in
metrics.jsonl, polled every 10 ms: the row is written when that step's metrics are read, one step
late); the parts are the `restart` row's (this code only). Writes nothing outside a temporary
directory. Results: benchmarks/RESULTS.md, "Restart: fault to first step".

  python benchmarks/restart.py [--config tiny] [--steps 4] [--repeats 5] [--base DIR]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("imports", "backend", "setup", "restore", "compile", "first_step", "total")


def command(config: str, workdir: str, steps: int, extra=()) -> list[str]:
  return [sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/{config}.py",
          f"--workdir={workdir}", "--no_sample", f"--config.train.steps={steps}",
          f"--config.checkpoint.every_steps={steps // 2}", "--config.train.log_every=1",
          "--config.train.eval_every=0", "--config.optim.warmup_steps=0", *extra]


def environment(code: str) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k != "JAX_COMPILATION_CACHE_DIR" and not k.startswith("JAX_PERSISTENT_CACHE")}
  return {**env, "PYTHONPATH": code, "JAX_PLATFORMS": "cpu"}


def restart(config: str, template: str, workdir: str, steps: int, code: str, extra=()) -> dict:
  """One restart of a fresh copy of `template`: seconds from the process's start to the resumed
  first step's row, and the restart row when the code writes one."""
  shutil.rmtree(workdir, ignore_errors=True)
  shutil.copytree(template, workdir)
  metrics = os.path.join(workdir, "metrics.jsonl")
  seen = os.path.getsize(metrics)
  first = steps // 2 + 1
  start = time.time()
  proc = subprocess.Popen(command(config, workdir, steps, extra), cwd=code, env=environment(code),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  until = None
  while proc.poll() is None and until is None:
    with open(metrics) as f:
      f.seek(seen)
      rows = [json.loads(line) for line in f if line.endswith("\n")]
    if any(r["step"] == first and "loss" in r for r in rows):
      until = time.time() - start
    time.sleep(0.01)
  out, err = proc.communicate()
  if proc.returncode:
    raise SystemExit(f"restart failed ({proc.returncode}): {err[-2000:]}")
  rows = [json.loads(line) for line in open(metrics)]
  row = next((r for r in rows if r.get("event") == "restart"), {})
  return {"until_row": until, **{p: row.get(f"restart_{p}_s") for p in PARTS},
          "hits": row.get("restart_cache_hits"), "misses": row.get("restart_cache_misses")}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny")
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--base", default=None, help="a checkout of an earlier commit, restarted too")
  a = p.parse_args()
  with tempfile.TemporaryDirectory(prefix="jaxtrain-restart-") as tmp:
    workdir = os.path.join(tmp, "run")
    codes = {"this": ROOT, **({"base": os.path.abspath(a.base)} if a.base else {})}
    templates = {}
    for name, code in codes.items():  # each code's own first run (the base knows fewer keys)
      t = time.time()
      done = subprocess.run(command(a.config, workdir, a.steps), cwd=code, env=environment(code),
                            capture_output=True, text=True)
      if done.returncode:
        raise SystemExit(done.stderr[-2000:])
      print(f"{a.config} ({name}): first run to step {a.steps} took {time.time() - t:.1f} s",
            flush=True)
      shutil.rmtree(os.path.join(workdir, "checkpoints", str(a.steps)))
      templates[code] = os.path.join(tmp, f"template_{name}")
      shutil.move(workdir, templates[code])
    modes = {"off": (ROOT, ["--config.train.compilation_cache="]), "cache": (ROOT, [])}
    if a.base:
      modes = {"base": (codes["base"], []), **modes}
    runs = {m: [] for m in modes}
    for r in range(a.repeats):
      for mode, (code, extra) in modes.items():
        runs[mode].append(restart(a.config, templates[code], workdir, a.steps, code, extra))
        print(f"  repeat {r} {mode}: " + json.dumps(runs[mode][-1]), flush=True)
  median = lambda xs: statistics.median(xs) if xs and None not in xs else float("nan")
  cols = ("until_row",) + PARTS
  print(f"\n{a.config}, medians of {a.repeats} restarts (seconds from the process's start):")
  print("| mode | first step row | " + " | ".join(PARTS) + " | cache hits/misses |")
  print("|---" * (len(cols) + 2) + "|")
  for mode, rs in runs.items():
    values = [median([r[c] for r in rs]) for c in cols]
    hits = f"{rs[0]['hits']}/{rs[0]['misses']}" if rs[0]["hits"] is not None else "-"
    print(f"| {mode} | " + " | ".join("-" if v != v else f"{v:.2f}" for v in values)
          + f" | {hits} |")


if __name__ == "__main__":
  main()
