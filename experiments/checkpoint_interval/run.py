"""Checkpoint interval against lost work under failures: fixed intervals and the adaptive policy, measured in steps
recomputed and saves made.

  python experiments/checkpoint_interval/run.py [--quick] [--out DIR] [--root DIR]

1. Trace: one uninterrupted run of config.py (its loss, gradient norm and skip counter per step; step and save times).
2. Replay: for each policy (config.ARGS), each mean time between failures (MTBF, in computed steps) and each seed,
   failures drawn from a seeded geometric distribution strike the training; the policy's own code
   (jaxtrain/checkpoint/policy.py for adaptive, Orbax's every-N rule for fixed) decides the saves on the traced values;
   a failure sends training back to the newest save and starts a fresh policy (a new process). Counts steps
   recomputed, saves and restarts.
3. Real: for a few policies and one failure schedule, real training runs that really fail (an exception raised inside
   the loop, before the step after the failure: no final save) and resume from their newest checkpoint, until done;
   their recomputed steps against the replay's for the same schedule (equal when the replay is right: a resumed run
   is bitwise the uninterrupted one, so the adaptive policy sees the same values).
Writes results.json, table.md and lost_work.png to --out (default: this folder, where the full study also rewrites
the table in README.md between its markers; --quick: runs/quick beside it). One CPU device."""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain, not an installed copy
  sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

FULL = {"steps": 300, "mtbf": (25, 50, 100, 200), "seeds": 200, "real": ("fixed_10", "adaptive_10_200"),
        "real_mtbf": 100}
QUICK = {"steps": 24, "mtbf": (8, 16), "seeds": 20, "real": ("fixed_5",), "real_mtbf": 20}


def load_study_config():
  spec = importlib.util.spec_from_file_location("checkpoint_interval_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ---- the replay: a policy's saves on traced values, under failures ----

def failure_steps(mtbf: float, seed: int, horizon: int) -> list[int]:
  """Computed-step counts (recomputed steps count too) at which failures strike: geometric gaps, mean `mtbf`."""
  rng = np.random.default_rng(seed)
  out, at = [], 0
  while at < horizon:
    at += int(rng.geometric(1 / mtbf))
    out.append(at)
  return out


class Fixed:
  """Orbax's FixedIntervalPolicy: a save at every multiple of n."""

  def __init__(self, n: int):
    self.n = n

  def observe(self, *values):
    pass

  def should_save(self, step: int, last: int, in_flight: bool = False) -> bool:
    return step % self.n == 0  # a save in flight does not stop it (the next save waits for it, blocking the loop)

  def saved(self, step: int):
    pass


class Adaptive:
  """jaxtrain's AdaptivePolicy itself, asked as the checkpoint manager asks it."""

  def __init__(self, min_steps: int, max_steps: int, spike: float):
    from jaxtrain.checkpoint.policy import AdaptivePolicy
    self.policy = AdaptivePolicy(min_steps, max_steps, spike)

  def observe(self, step: int, loss: float, grad_norm: float, skipped: float):
    self.policy.observe(step, loss, grad_norm, skipped)

  def should_save(self, step: int, last: int, in_flight: bool = False) -> bool:
    info = types.SimpleNamespace
    previous = [info(step=last)] if last else []
    return self.policy.should_save(info(step=step), previous, context=info(is_saving_in_progress=in_flight))

  def saved(self, step: int):
    self.policy.saved(step)


def make_policy(cfg):
  k = cfg.checkpoint
  return Adaptive(k.adaptive_min_steps, k.adaptive_max_steps, k.adaptive_spike) if k.adaptive else Fixed(k.every_steps)


def replay(trace: dict, new_policy, failures: list[int], steps: int, busy: int = 0) -> dict:
  """The loop's order (train/loop.py): step s+1 runs, step s's values reach the policy, a due save of s+1 is made
  (never at the last step: the final save is forced); a failure strikes after that, before the next step. A save
  stays in flight for `busy` steps (the adaptive policy waits for it; a new process has none in flight)."""
  policy, s, last, computed, pending, started = new_policy(), 0, 0, 0, None, None
  saves = recomputed = restarts = 0
  failures = iter(failures)
  fail_at = next(failures, None)
  while s < steps:
    if pending is not None:
      policy.observe(pending, *trace[pending])
    s, computed, pending = s + 1, computed + 1, s + 1
    in_flight = started is not None and computed - started < busy
    if s < steps and policy.should_save(s, last, in_flight):
      last, saves, started = s, saves + 1, computed
      policy.saved(s)
    if computed == fail_at:
      fail_at = next(failures, None)
      if s < steps:
        recomputed, restarts = recomputed + s - last, restarts + 1
        s, policy, pending, started = last, new_policy(), None, None
  return {"recomputed": recomputed, "saves": saves, "restarts": restarts, "computed": computed}


# ---- real runs ----

class Failure(Exception):
  """A simulated crash of the training process."""


def failing_task(cfg, workdir: str, at_step: int | None):
  """The language model, crashing when the loop asks for the batch after step `at_step` (never with None)."""
  from jaxtrain.core.lm import LanguageModel
  task = LanguageModel(cfg, workdir)
  make_batch = task.make_batch

  def make_or_fail(params, extra, task_state, batch, step):
    if step == at_step:
      raise Failure(f"simulated failure after step {step}")
    return make_batch(params, extra, task_state, batch, step)
  task.make_batch = make_or_fail
  return task


def newest_checkpoint(workdir: str) -> int:
  directory = os.path.join(workdir, "checkpoints")
  steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
  return max(steps, default=0)


class CountSaves:
  """Counts the saves the loop starts before the last step (the policy's; the final one is forced). Counted at the
  call, since a run that dies never writes the rows of the saves still in flight."""

  def __init__(self, last_step: int):
    from jaxtrain.checkpoint import Checkpoints
    self.cls, self.save, self.last_step, self.count = Checkpoints, Checkpoints.save, last_step, 0

  def __enter__(self):
    def save(ckpts, step, *args, **kwargs):
      if step < self.last_step:
        self.count += 1
      return self.save(ckpts, step, *args, **kwargs)
    self.cls.save = save
    return self

  def __exit__(self, *exc):
    self.cls.save = self.save


def real_run(cfg, workdir: str, failures: list[int]) -> dict:
  """Trains to the end through the failures (computed-step counts); recomputed steps, saves, restarts, and the
  goodput columns of the last run."""
  import jax
  shutil.rmtree(workdir, ignore_errors=True)
  with CountSaves(cfg.train.steps) as saves:
    measured = _fail_and_resume(cfg, workdir, failures, jax.devices()[:1])
  return {**measured, "saves": saves.count}


def _fail_and_resume(cfg, workdir: str, failures: list[int], devices) -> dict:
  import jaxtrain
  steps, s, computed, recomputed, restarts = cfg.train.steps, 0, 0, 0, 0
  failures = [f for f in failures]
  start = time.perf_counter()
  while True:
    at = s + failures[0] - computed if failures else None
    if at is not None and at >= steps:
      at = None
    try:
      final = jaxtrain.train(cfg, workdir, task=failing_task(cfg, workdir, at), progress=False, devices=devices)
      break
    except Failure:
      computed += at - s
      failures.pop(0)
      s = newest_checkpoint(workdir)
      recomputed, restarts = recomputed + at - s, restarts + 1
  return {"recomputed": recomputed, "restarts": restarts, "goodput_lost_steps": final["lost_steps"],
          "goodput": final["goodput"], "wall_s": time.perf_counter() - start, "badput_lost_s": final["badput_lost_s"],
          "badput_checkpoint_s": final["badput_checkpoint_s"],
          "badput_restore_s": final["badput_restore_s"]}


def trace_run(cfg, workdir: str) -> tuple[dict, float, float, float]:
  """One uninterrupted run: {step: (loss, grad_norm, skipped)}, median seconds of a step, of a save's blocking part
  and of a whole (asynchronous) save."""
  import jax
  import jaxtrain
  shutil.rmtree(workdir, ignore_errors=True)
  jaxtrain.train(cfg, workdir, progress=False, devices=jax.devices()[:1])
  rows = jaxtrain.read_metrics(workdir, as_frame=False)
  steps = [r for r in rows if "event" not in r and "loss" in r]
  trace = {r["step"]: (r["loss"], r["grad_norm"], r.get("skipped_steps", 0.0)) for r in steps}
  step_s = statistics.median(r["step_time_s"] for r in steps[1:])
  saves = [r for r in rows if r.get("event") == "checkpoint_save"]
  return (trace, step_s, statistics.median(r["save_blocking_s"] for r in saves),
          statistics.median(r["save_total_s"] for r in saves))


# ---- the study ----

def study(plan: dict, root: str) -> dict:
  import jax
  config = load_study_config()
  configs = {arg: config.get_config(arg) for arg in config.ARGS}
  for cfg in configs.values():
    cfg.train.steps = plan["steps"]
  steps = plan["steps"]
  trace, step_s, save_s, save_total_s = trace_run(configs["fixed_10"], os.path.join(root, "trace"))
  busy = round(save_total_s / step_s)  # steps a save stays in flight on this machine
  rows = []
  for mtbf in plan["mtbf"]:
    for arg, cfg in configs.items():
      runs = [replay(trace, lambda cfg=cfg: make_policy(cfg), failure_steps(mtbf, seed, 4 * steps), steps)
              for seed in range(plan["seeds"])]
      mean = {k: float(np.mean([r[k] for r in runs])) for k in ("recomputed", "saves", "restarts")}
      rows.append({"policy": arg, "mtbf": mtbf, **mean,
                   "recomputed_per_failure": mean["recomputed"] / max(mean["restarts"], 1e-9),
                   "overhead_s": mean["recomputed"] * step_s + mean["saves"] * save_s})
  real = []
  schedule = failure_steps(plan["real_mtbf"], 0, 4 * steps)
  for arg in plan["real"]:
    cfg = configs[arg]
    measured = real_run(cfg, os.path.join(root, f"real_{arg}"), schedule)
    replayed = replay(trace, lambda cfg=cfg: make_policy(cfg), schedule, steps)
    busy_replay = replay(trace, lambda cfg=cfg: make_policy(cfg), schedule, steps, busy)
    real.append({"policy": arg, "mtbf": plan["real_mtbf"], "real": measured, "replay": replayed,
                 "replay_busy": busy_replay})
    print(f"real {arg}: recomputed {measured['recomputed']} (replay {replayed['recomputed']}, "
          f"{busy_replay['recomputed']} with saves in flight), saves {measured['saves']} (replay {replayed['saves']}, "
          f"{busy_replay['saves']}), restarts {measured['restarts']}", flush=True)
  return {"steps": steps, "seeds": plan["seeds"], "step_s": step_s, "save_blocking_s": save_s,
          "save_total_s": save_total_s, "busy_steps": busy, "rows": rows,
          "real": real, "schedule": [f for f in schedule if f < 2 * steps],
          "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].device_kind}",
          "jax": jax.__version__, "python": platform.python_version(), "date": str(datetime.date.today())}


def table(result: dict) -> str:
  lines = ["| MTBF (steps) | policy | saves | restarts | steps recomputed | per failure | overhead (s) |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
  for r in result["rows"]:
    lines.append(f"| {r['mtbf']} | {r['policy']} | {r['saves']:.1f} | {r['restarts']:.2f} | {r['recomputed']:.1f} | "
                 f"{r['recomputed_per_failure']:.1f} | {r['overhead_s']:.2f} |")
  if not result["real"]:
    return "\n".join(lines) + "\n"
  lines += ["", f"| real run (MTBF {result['real'][0]['mtbf']}, seed 0) | recomputed: real / replay / replay in flight "
            f"| saves: real / replay / replay in flight | restarts | goodput's lost_steps | goodput | wall (s) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in result["real"]:
    m, p, b = r["real"], r["replay"], r.get("replay_busy", r["replay"])
    lines.append(f"| {r['policy']} | {m['recomputed']} / {p['recomputed']} / {b['recomputed']} | {m['saves']} / "
                 f"{p['saves']} / {b['saves']} | {m['restarts']} | {m['goodput_lost_steps']} | {m['goodput']:.1%} | "
                 f"{m['wall_s']:.1f} |")
  return "\n".join(lines) + "\n"


MARKERS = ("<!-- results:begin -->", "<!-- results:end -->")


def update_readme(path: str, text: str):
  """Replaces what lies between the README's markers with `text`."""
  readme = open(path).read()
  head, rest = readme.split(MARKERS[0])
  _, tail = rest.split(MARKERS[1])
  with open(path, "w") as f:
    f.write(f"{head}{MARKERS[0]}\n{text}{MARKERS[1]}{tail}")


def plot(result: dict, path: str):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(7.5, 5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  for i, mtbf in enumerate(sorted({r["mtbf"] for r in result["rows"]})):
    rows = [r for r in result["rows"] if r["mtbf"] == mtbf]
    fixed = [r for r in rows if r["policy"].startswith("fixed")]
    color = f"C{i}"
    ax.plot([r["saves"] for r in fixed], [r["recomputed"] for r in fixed], "o-", color=color,
            label=f"fixed intervals, MTBF {mtbf}")
    for r in rows:
      if r["policy"].startswith("adaptive"):
        ax.plot(r["saves"], r["recomputed"], "*" if r["policy"].endswith("200") else "s", color=color, ms=11,
                label=f"{r['policy']}, MTBF {mtbf}")
  ax.set_xlabel(f"saves per run of {result['steps']} steps (mean over {result['seeds']} failure draws)")
  ax.set_ylabel("steps recomputed (mean)")
  ax.set_xscale("log")
  if all(r["recomputed"] > 0 for r in result["rows"]):
    ax.set_yscale("log")
  ax.legend(fontsize=7, ncol=2, loc="lower left")
  ax.set_title("checkpoint interval vs lost work")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few seconds' version (24 steps, one real policy)")
  parser.add_argument("--out", default=None, help="where results.json, table.md and lost_work.png go")
  parser.add_argument("--root", default=None, help="where the workdirs go (default: runs/ beside this file)")
  args = parser.parse_args(argv)
  out = args.out or (os.path.join(HERE, "runs", "quick") if args.quick else HERE)
  root = args.root or os.path.join(HERE, "runs", "quick" if args.quick else "full")
  os.makedirs(out, exist_ok=True)
  start = time.perf_counter()
  result = study(QUICK if args.quick else FULL, root)
  result["command"] = "python experiments/checkpoint_interval/run.py" + (" --quick" if args.quick else "")
  result["wall_s"] = time.perf_counter() - start
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(table(result))
  plot(result, os.path.join(out, "lost_work.png"))
  if out == HERE and not args.quick:
    update_readme(os.path.join(HERE, "README.md"), table(result))
  print(table(result))
  print(f"wrote {out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
  main()
