"""Trains configs/tiny.py as replica=4 x data=2 under each communication scheme, then tabulates and plots
eval loss against the bytes sent over the replica axis, and projects the bytes onto larger models.

  python experiments/comm_efficiency/run.py [--steps N] [--only NAME,...] [--root DIR] [--out DIR]

Each scheme (config.SCHEMES) trains in its own workdir under --root (default runs/ beside this file,
git-ignored); a run whose metrics already reach its last step with an eval is skipped, an unfinished
one starts over. Then it writes results.json, table.md and loss_vs_bytes.png to --out (default: this
folder for the full default study, all schemes at 400 steps, which also rewrites the tables in
README.md between the markers; else the runs' folder). Sets 8
virtual CPU devices itself, before jax is imported."""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import matplotlib  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain.train import comm  # noqa: E402

BASELINE = "f32_dp"
NOISE = "f32_implicit"  # not a scheme: f32 DP up to float reassociation (config.py)
MARKERS = {"table": ("<!-- results:begin -->", "<!-- results:end -->"),
           "curves": ("<!-- curves:begin -->", "<!-- curves:end -->"),
           "projection": ("<!-- projection:begin -->", "<!-- projection:end -->")}
PROJECTED = ("f32_dp", "bf16", "int8", "int4_ef", "diloco_h10", "diloco_h50", "diloco_h50_int8",
             "streaming_h50_p2_d5_int4")


def load_study_config():
  """This folder's config.py as a module (its get_config, SCHEMES and ARGS)."""
  spec = importlib.util.spec_from_file_location("comm_efficiency_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def finished(workdir: str, steps: int) -> bool:
  """Whether `workdir` holds a run that logged its last step with an eval."""
  if not os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
    return False
  return any(r.get("step") == steps and "eval_loss" in r for r in jaxtrain.read_metrics(workdir, as_frame=False))


def train(cfg, workdir: str) -> float:
  """Trains one scheme from scratch; its wall time (compile and evals included) goes to wall_s.json."""
  start = time.perf_counter()
  jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True, start_over=True)
  wall = time.perf_counter() - start
  with open(os.path.join(workdir, "wall_s.json"), "w") as f:
    json.dump({"wall_s": wall}, f)
  return wall


def replica_bytes(row: dict) -> float:
  """Bytes per device per optimizer step over every collective whose groups span the replica axis."""
  return sum(v for k, v in row.items() if k.startswith("comm_bytes_") and "replica" in k[11:].split(","))


def summarize(name: str, overrides: dict, workdir: str, steps: int) -> dict:
  """The run's final losses, curves and bytes, from its metrics.jsonl."""
  rows = [r for r in jaxtrain.read_metrics(workdir, as_frame=False) if "event" not in r and "loss" in r]
  final = [r for r in rows if r["step"] == steps and "eval_loss" in r][-1]
  per_step = replica_bytes(final)
  wall = os.path.join(workdir, "wall_s.json")
  timed = sorted(r["step_time_s"] for r in rows if r["step"] > 1 and "eval_loss" not in r)
  return {"scheme": name, "overrides": overrides, "workdir": os.path.relpath(workdir, ROOT),
          "loss": final["loss"], "eval_loss": final["eval_loss"], "entropy_floor": final["entropy_floor"],
          "eval_entropy_floor": final["eval_entropy_floor"], "bytes_replica_per_step": per_step,
          "bytes_data_per_step": final.get("comm_bytes_data", 0.0), "comm_bytes": final["comm_bytes"],
          "median_step_time_s": timed[len(timed) // 2] if timed else None,
          "wall_s": json.load(open(wall))["wall_s"] if os.path.isfile(wall) else None,
          "train_curve": [(r["step"], r["loss"]) for r in rows],
          "eval_curve": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]}


def add_relative(results: list[dict]) -> None:
  """Eval loss relative to f32 DP's, and f32 DP's bytes over each scheme's (when DP ran)."""
  base = next((r for r in results if r["scheme"] == BASELINE), None)
  for r in results:
    r["eval_vs_dp"] = r["eval_loss"] / base["eval_loss"] - 1 if base else None
    r["bytes_ratio"] = base["bytes_replica_per_step"] / r["bytes_replica_per_step"] if base else None


def targets(results: list[dict]) -> list[dict]:
  """The issue's quality targets, each measured against the runs it names (those that ran)."""
  by = {r["scheme"]: r["eval_loss"] for r in results}
  checks = [("int8 within 0.5% of f32 DP", "int8", BASELINE, 0.005),
            ("int4+ef within 0.5% of f32 DP", "int4_ef", BASELINE, 0.005),
            ("int4+ef21 within 0.5% of f32 DP", "int4_ef21", BASELINE, 0.005),
            ("DiLoCo H=10 within 2% of f32 DP", "diloco_h10", BASELINE, 0.02),
            ("DiLoCo H=50 within 5% of f32 DP", "diloco_h50", BASELINE, 0.05),
            ("int8 DiLoCo H=10 within 0.5% of f32 DiLoCo H=10", "diloco_h10_int8", "diloco_h10", 0.005),
            ("int8 DiLoCo H=50 within 0.5% of f32 DiLoCo H=50", "diloco_h50_int8", "diloco_h50", 0.005)]
  out = [{"target": t, "value": by[a] / by[b] - 1, "limit": lim, "met": by[a] / by[b] - 1 <= lim}
         for t, a, b, lim in checks if a in by and b in by]
  for fb in ("int4_ef", "int4_ef21"):
    if fb in by and "int4" in by:
      out.append({"target": f"{fb.replace('int4_', 'int4+')} better than int4 without feedback",
                  "value": by[fb] / by["int4"] - 1, "limit": 0.0, "met": by[fb] < by["int4"]})
  return out


def format_table(results: list[dict], steps: int) -> str:
  lines = [f"| scheme | train loss (step {steps}) | eval loss | eval / floor | eval vs f32 DP | bytes/step over "
           "replica | f32 DP / scheme |", "|---|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    rel = "" if r["eval_vs_dp"] is None else f"{r['eval_vs_dp']:+.2%}"
    ratio = "" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.1f}x"
    name = f"{r['scheme']} (noise reference)" if r["scheme"] == NOISE else r["scheme"]
    lines.append(f"| {name} | {r['loss']:.4f} | {r['eval_loss']:.4f} | "
                 f"{r['eval_loss'] / r['eval_entropy_floor']:.4f} | {rel} | {r['bytes_replica_per_step']:,.0f} | "
                 f"{ratio} |")
  return "\n".join(lines)


def format_curves(results: list[dict]) -> str:
  """Eval loss at every eval step, a row per scheme: where the schemes differ before the plateau."""
  steps = [s for s, _ in results[0]["eval_curve"]]
  lines = ["| scheme | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---:|" * len(steps)]
  for r in results:
    by = dict(r["eval_curve"])
    lines.append(f"| {r['scheme']} | " + " | ".join(f"{by[s]:.3f}" if s in by else "" for s in steps) + " |")
  return "\n".join(lines)


def format_targets(checks: list[dict]) -> str:
  lines = ["| target | measured | met |", "|---|---:|---|"]
  for c in checks:
    lines.append(f"| {c['target']} | {c['value']:+.2%} | {'yes' if c['met'] else '**no**'} |")
  return "\n".join(lines)


def plot(results: list[dict], out: str) -> None:
  """Eval and train loss against cumulative bytes sent over replica per device (log x), a line per
  scheme. Cumulative bytes = step x the step's average bytes (DiLoCo sends them in bursts at syncs)."""
  fig = Figure(figsize=(13, 5.5), dpi=100, layout="constrained")
  FigureCanvasAgg(fig)
  colors = matplotlib.colormaps["tab20"].colors
  for ax, (curve, title) in zip(fig.subplots(1, 2), (("eval_curve", "eval loss"), ("train_curve", "training loss"))):
    for i, r in enumerate(r for r in results if r["scheme"] != NOISE):
      points = [(s * r["bytes_replica_per_step"], v) for s, v in r[curve] if s > 0]
      style = "--" if r["scheme"].startswith(("diloco", "streaming")) else "-"
      ax.plot(*zip(*points), style, color=colors[i % len(colors)], marker="." if curve == "eval_curve" else None,
              label=r["scheme"])
    floor = results[0]["eval_entropy_floor" if curve == "eval_curve" else "entropy_floor"]
    ax.axhline(floor, color="gray", ls=":", label="entropy floor")
    ax.set_xscale("log")
    last = max(r[curve][-1][1] for r in results)  # the end of the learning phase and the plateau
    ax.set_ylim(floor - 0.05, max(floor + 0.65, last + 0.1))
    ax.set_xlabel("cumulative bytes sent over replica per device")
    ax.set_title(f"{title} vs bytes over the replica axis")
    ax.grid(alpha=0.3, which="both")
  fig.axes[0].legend(fontsize="small")
  fig.savefig(out)


def projection(study, names: list[str]) -> str:
  """comm.run's bytes report and projection for the schemes, on the study's mesh (measured bytes per
  parameter). Streaming DiLoCo hides a sync behind tau steps once every H/P steps: tau P / H per step."""
  base = study.get_config(BASELINE)
  schemes = []
  for name in names:
    o = study.SCHEMES[name]
    h, p, tau = o.get("diloco.inner_steps", 0), o.get("diloco.fragments", 1), o.get("diloco.delay", 0)
    schemes.append(comm.Scheme(name, o, tau * p / h if tau else 0.0))
  return comm.run(base, projection=True, schemes=schemes)


def replace_between(text: str, markers: tuple[str, str], body: str) -> str:
  begin, end = markers
  head, rest = text.split(begin)
  return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=0, help="train steps (0: the config's, 400)")
  parser.add_argument("--only", default="", help="comma-separated schemes (default: all)")
  parser.add_argument("--root", default=os.path.join(HERE, "runs"), help="where the workdirs go")
  parser.add_argument("--out", default="", help="where results.json, table.md and the plot go (default: this "
                      "folder for the full default study, else the runs' folder)")
  parser.add_argument("--no_projection", action="store_true", help="skip comm.run's projection")
  args = parser.parse_args()
  os.chdir(ROOT)  # comm.project reads configs/<model>.py relative to the repository
  study = load_study_config()
  steps = args.steps or study.STEPS
  names = args.only.split(",") if args.only else list(study.ARGS)
  unknown = set(names) - set(study.ARGS)
  if unknown:
    parser.error(f"unknown schemes {sorted(unknown)}; choose from {', '.join(study.ARGS)}")
  machine = (f"{datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}, "
             f"{jax.devices()[0].device_kind} x {jax.device_count()}, {os.cpu_count()} cores")
  print(machine, flush=True)
  root = os.path.join(args.root, f"steps{steps}")
  full = not args.only and steps == study.STEPS
  out = args.out or (HERE if full else root)
  for name in names:
    workdir = os.path.join(root, name)
    if finished(workdir, steps):
      print(f"{name}: finished already ({workdir})", flush=True)
      continue
    wall = train(study.get_config(name, steps), workdir)
    print(f"{name}: trained in {wall:.0f} s", flush=True)

  results = [summarize(n, study.SCHEMES[n], os.path.join(root, n), steps) for n in names]
  add_relative(results)
  checks = targets(results)
  table, target_table, curves = format_table(results, steps), format_targets(checks), format_curves(results)
  print(table + "\n\n" + target_table + "\n\n" + curves, flush=True)
  proj = "" if args.no_projection else projection(study, [n for n in PROJECTED if n in names])
  print(proj, flush=True)
  os.makedirs(out, exist_ok=True)
  command = "python experiments/comm_efficiency/run.py" + (f" --steps {args.steps}" if args.steps else "") + (
      f" --only {args.only}" if args.only else "")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"machine": machine, "command": command, "steps": steps, "results": results, "targets": checks,
               "projection": proj}, f, indent=1)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(f"{machine}\n\n`{command}`\n\n{table}\n\n{target_table}\n\nEval loss along the way:\n\n{curves}\n")
  plot(results, os.path.join(out, "loss_vs_bytes.png"))
  print(f"wrote results.json, table.md, loss_vs_bytes.png to {out}", flush=True)
  readme = os.path.join(HERE, "README.md")
  if os.path.abspath(out) == HERE and full and os.path.isfile(readme):
    text = open(readme).read()
    if all(m in text for pair in MARKERS.values() for m in pair):
      text = replace_between(text, MARKERS["table"], f"{table}\n\n{target_table}")
      text = replace_between(text, MARKERS["curves"], curves)
      if proj:
        text = replace_between(text, MARKERS["projection"], f"```\n{proj}\n```")
      with open(readme, "w") as f:
        f.write(text)
      print(f"updated {readme}", flush=True)


if __name__ == "__main__":
  main()
