"""Float32 against bfloat16 compute on small_20m: step speed side by side, loss curves, and how far they diverge.

  python experiments/precision/run.py [--quick] [--steps N] [--repeats R] [--root DIR] [--out DIR]

1. Speed: both configs' train steps (the loop's own, `builder.compile_steps`), compiled on one CPU
   device,
   then R rounds of one float32 step and one bfloat16 step alternating on the same batches, so that load
   from other processes falls on both alike; median step time -> tokens/s. Compiled memory of each step.
2. Curves: each config trained from scratch with `jaxtrain.train` (same seed and batches) in --root/NAME,
   every step's loss logged; |loss_bf16 - loss_f32| step by step and at each evaluation.
3. `tools/compare_runs.py`'s table, `tools/plot_metrics.py`'s curves.png, and precision.png (curves and
   the difference) with results.json and table.md in --out (default: this folder for the full study, which
   also rewrites README.md's table between its markers; --quick or other --steps: the runs' folder).
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain and tools, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain import data, parallel  # noqa: E402
from jaxtrain import builder  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402
from tools.compare_runs import compare, format_table  # noqa: E402
from tools.plot_metrics import plot  # noqa: E402

MARKERS = ("<!-- results:begin -->", "<!-- results:end -->")
SHORT = {"float32": "f32", "bfloat16": "bf16"}


def load_study_config():
  """This folder's config.py as a module (its get_config, ARGS and STEPS)."""
  spec = importlib.util.spec_from_file_location("precision_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def machine() -> dict:
  """Where and when: date, CPU, cores, jax version, load average at the call."""
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
             platform.processor() or "unknown") if os.path.isfile("/proc/cpuinfo") else platform.processor()
  return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
          "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
          "load_average": [round(x, 1) for x in os.getloadavg()]}


class Stepper:
  """`cfg`'s train step as the loop compiles it, on one device, with its own state; `step(i)` runs it on
  global batch i and returns the seconds until the metrics are on the host."""

  def __init__(self, cfg, device):
    mesh, task, tx, schedule = builder.build(cfg, "", [device])
    self.state, shardings = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
    self.feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
    self.source = data.make_source(cfg, "train")
    self.contexts = lambda: parallel.activate(mesh, cfg.mesh.rules)
    with self.contexts():
      train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
      self.compiled = train_fn.lower(self.state, self.feed.batch(self.source, 0)).compile()
    self.tokens = task.batch_size * cfg.train.seq_len
    self.memory = self.compiled.memory_analysis()

  def step(self, index: int) -> float:
    batch = self.feed.batch(self.source, index)
    with self.contexts():
      start = time.perf_counter()
      self.state, step_metrics = self.compiled(self.state, batch)
      jax.block_until_ready(step_metrics)
      return time.perf_counter() - start


def side_by_side(cfgs: dict, repeats: int, device) -> dict:
  """{name: {"times": [s, ...], median, tokens_per_sec, temp_bytes}}: one warm-up step each, then
  `repeats` rounds alternating the configs on the same batch."""
  steppers = {name: Stepper(cfg, device) for name, cfg in cfgs.items()}
  for stepper in steppers.values():
    stepper.step(0)
  times = {name: [] for name in steppers}
  for i in range(repeats):
    for name, stepper in steppers.items():
      times[name].append(stepper.step(i + 1))
  out = {}
  for name, stepper in steppers.items():
    median = statistics.median(times[name])
    out[name] = {"times": times[name], "median_step_s": median, "tokens_per_sec": stepper.tokens / median,
                 "temp_bytes": stepper.memory.temp_size_in_bytes}
  del steppers
  return out


def train(cfg, workdir: str, device) -> dict:
  """Trains from scratch; the run's per-step losses and eval losses, and its wall time."""
  start = time.perf_counter()
  jaxtrain.train(cfg, workdir, devices=[device], progress=False, sync_every_step=True, start_over=True)
  wall = time.perf_counter() - start
  rows = [r for r in jaxtrain.read_metrics(workdir, as_frame=False) if "event" not in r and "loss" in r]
  timed = [r["step_time_s"] for r in rows[1:] if "eval_loss" not in r]  # not the first (compile), no evals
  return {"workdir": os.path.relpath(workdir, ROOT), "wall_s": wall, "loss": {r["step"]: r["loss"] for r in rows},
          "eval_loss": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
          "train_median_step_s": statistics.median(timed) if timed else None,
          "eval_entropy_floor": next((r["eval_entropy_floor"] for r in rows if "eval_entropy_floor" in r), None)}


def divergence(ref: dict, other: dict) -> dict:
  """|other - ref| of the training loss at every step both logged, and of the eval loss at every eval."""
  steps = sorted(set(ref["loss"]) & set(other["loss"]))
  diff = {s: other["loss"][s] - ref["loss"][s] for s in steps}
  worst = max(steps, key=lambda s: abs(diff[s]))
  evals = sorted(set(ref["eval_loss"]) & set(other["eval_loss"]))
  eval_diff = {s: other["eval_loss"][s] - ref["eval_loss"][s] for s in evals}
  tail = steps[-max(1, len(steps) // 4):]
  return {"steps": len(steps), "max_abs": abs(diff[worst]), "max_step": worst, "final": diff[steps[-1]],
          "final_step": steps[-1], "mean_abs": statistics.fmean(abs(d) for d in diff.values()),
          "mean_abs_last_quarter": statistics.fmean(abs(diff[s]) for s in tail),
          "eval": {str(s): d for s, d in eval_diff.items()},
          "eval_final": eval_diff[evals[-1]] if evals else None,
          "eval_max_abs": max((abs(d) for d in eval_diff.values()), default=None),
          "loss_drop_ref": ref["loss"][steps[0]] - ref["loss"][steps[-1]]}


def format_tables(results: dict) -> str:
  """The README's tables: speed, losses, divergence."""
  speed, runs, div = results["speed"], results["runs"], results["divergence"]
  base = speed["float32"]["median_step_s"]
  lines = ["| compute | step (median of alternating repeats) | tokens/s | vs float32 | step in training run (median) "
           "| compiled temp memory | train wall |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name in results["args"]:
    s, r = speed[name], runs[name]
    train_step = f"{r['train_median_step_s']:.3f} s" if r["train_median_step_s"] else "-"
    lines.append(f"| {name} | {s['median_step_s']:.3f} s | {s['tokens_per_sec']:,.0f} | "
                 f"{base / s['median_step_s']:.2f}x | {train_step} | {s['temp_bytes'] / 2**20:,.1f} MiB | "
                 f"{r['wall_s']:.0f} s |")
  lines += ["", "| compute | first loss | final loss | eval loss (last) | eval - floor |", "|---|---:|---:|---:|---:|"]
  for name in results["args"]:
    r = runs[name]
    first, last = min(r["loss"]), max(r["loss"])
    ev = r["eval_loss"][max(r["eval_loss"])]
    floor = r["eval_entropy_floor"]
    gap = f"{ev - floor:.4f}" if floor is not None else "-"
    lines.append(f"| {name} | {r['loss'][first]:.4f} | {r['loss'][last]:.4f} | {ev:.4f} | {gap} |")
  lines += ["", f"| bf16 - f32 over {div['steps']} steps | value |", "|---|---:|",
            f"| max \\|Δ train loss\\| | {div['max_abs']:.4f} (step {div['max_step']}) |",
            f"| mean \\|Δ train loss\\| | {div['mean_abs']:.4f} |",
            f"| mean \\|Δ train loss\\|, last quarter | {div['mean_abs_last_quarter']:.4f} |",
            f"| final Δ train loss (step {div['final_step']}) | {div['final']:+.4f} |",
            f"| final Δ eval loss | {div['eval_final']:+.4f} |",
            f"| max \\|Δ eval loss\\| over evals | {div['eval_max_abs']:.4f} |",
            f"| f32 loss drop over the run, for scale | {div['loss_drop_ref']:.4f} |"]
  return "\n".join(lines)


def draw(results: dict, path: str):
  """Training and eval loss of both runs, and bf16 - f32 step by step."""
  fig = Figure(figsize=(12, 4.5), dpi=100)
  FigureCanvasAgg(fig)
  curves, delta = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  for name in results["args"]:
    r = results["runs"][name]
    steps = sorted(r["loss"])
    line, = curves.plot(steps, [r["loss"][s] for s in steps], label=f"{name} train", lw=1)
    evals = sorted(r["eval_loss"])
    curves.plot(evals, [r["eval_loss"][s] for s in evals], "o--", color=line.get_color(), label=f"{name} eval")
  curves.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
  curves.legend()
  ref, other = (results["runs"][a] for a in results["args"])
  steps = sorted(set(ref["loss"]) & set(other["loss"]))
  delta.plot(steps, [other["loss"][s] - ref["loss"][s] for s in steps], lw=1, label="train")
  evals = sorted(set(ref["eval_loss"]) & set(other["eval_loss"]))
  delta.plot(evals, [other["eval_loss"][s] - ref["eval_loss"][s] for s in evals], "o", label="eval")
  delta.axhline(0, color="gray", lw=0.5)
  delta.set(xlabel="step", ylabel="loss_bf16 - loss_f32", title="bfloat16 - float32")
  delta.legend()
  fig.tight_layout()
  fig.savefig(path)


def rewrite_readme(block: str):
  path = os.path.join(HERE, "README.md")
  text = open(path).read()
  begin, end = MARKERS
  head, rest = text.split(begin, 1)
  with open(path, "w") as f:
    f.write(head + begin + "\n" + block + "\n" + end + rest.split(end, 1)[1])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a 2-layer d_model 32 stand-in, 4 steps (the test)")
  parser.add_argument("--steps", type=int, default=0, help="training steps (0: config.STEPS, or 4 with --quick)")
  parser.add_argument("--repeats", type=int, default=0, help="alternating timing rounds (0: 3, or 2 with --quick)")
  parser.add_argument("--root", default="", help="where the workdirs go (default: runs/ beside this file)")
  parser.add_argument("--out", default="", help="where the tables and plots go (see above)")
  args = parser.parse_args(argv)
  study = load_study_config()
  steps = args.steps or (4 if args.quick else study.STEPS)
  repeats = args.repeats or (2 if args.quick else 3)
  full = not args.quick and steps == study.STEPS
  root = args.root or os.path.join(HERE, "runs", "quick" if args.quick else f"steps{steps}")
  out = args.out or (HERE if full else root)
  os.makedirs(out, exist_ok=True)
  device = jax.devices()[0]
  cfgs = {arg: study.get_config(arg, steps=steps, quick=args.quick) for arg in study.ARGS}
  command = "python experiments/precision/run.py" + (" --quick" if args.quick else "")
  results = {"machine": machine(), "command": command,
             "args": list(study.ARGS), "steps": steps, "repeats": repeats, "quick": args.quick}
  print(f"{results['machine']}", flush=True)
  start = time.perf_counter()
  results["speed"] = side_by_side(cfgs, repeats, device)
  print({k: round(v["median_step_s"], 3) for k, v in results["speed"].items()}, flush=True)
  results["runs"] = {}
  for arg, cfg in cfgs.items():
    results["runs"][arg] = train(cfg, os.path.join(root, arg), device)
    print(f"{arg}: {results['runs'][arg]['wall_s']:.0f} s", flush=True)
  results["divergence"] = divergence(*(results["runs"][a] for a in study.ARGS))
  results["wall_s"] = time.perf_counter() - start
  results["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
  tables = format_tables(results)
  workdirs = [os.path.join(ROOT, results["runs"][a]["workdir"]) for a in study.ARGS]
  compared = format_table(*compare(workdirs), "md")
  print(tables + "\n\n" + compared, flush=True)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(tables + "\n\n" + compared + "\n")
  plot(workdirs, os.path.join(out, "curves.png"))
  draw(results, os.path.join(out, "precision.png"))
  if out == HERE:
    m = results["machine"]
    rewrite_readme(f"Measured {m['date']} on {m['cpu']}, {m['cores']} cores, one CPU device, jax {m['jax']}, "
                   f"Python {m['python']}; load average {m['load_average']} at the start and "
                   f"{results['load_average_end']} at the end (the machine is shared). `{results['command']}` "
                   f"took {results['wall_s'] / 60:.1f} min.\n\n{tables}\n\n`tools/compare_runs.py`:\n\n{compared}")
  print(f"wrote {out}", flush=True)
  return results


if __name__ == "__main__":
  main()
