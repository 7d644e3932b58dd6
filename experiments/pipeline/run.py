"""Pipeline bubble, step time and memory against microbatches and repeats (config.ARGS).

  .venv-targets/bin/python experiments/pipeline/run.py [--steps N] [--out DIR]

For each layout: the schedule's bubble (S - 1) / (R M + S - 1) from the loop's own table
(`pipeline.bubble`); on 8 virtual CPU devices, the median over --passes of the median step time of
a short training run (the
stages share two cores, so the time measures the work every stage computes, bubble iterations
included: it grows as T / (M R), not as a parallel pipeline's would); compiled for a TPU v5p 2x2x2
slice (8 chips, deviceless: compiled, not executed), per-device memory and matmul FLOPs (each
stage computes in its bubble iterations too, so FLOPs grow by T / (M R) on the layer stack).
The TPU part needs libtpu (.venv-targets, `make test-targets`); without it the columns are empty.
Writes results.json and table.md to --out (default: this folder)."""

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain import metrics  # noqa: E402
from jaxtrain.aot import compile_for, targets  # noqa: E402
from jaxtrain.model import pipeline  # noqa: E402

TARGET = "tpu-v5p:2x2x2"
GIB, MIB = 1024**3, 1024**2


def load_study_config():
  spec = importlib.util.spec_from_file_location("pipeline_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def cpu_step_s(cfg) -> float:
  """Median step time of steps 3.. of a short run through the loop (steps 1-2: compile, warm-up)."""
  with tempfile.TemporaryDirectory() as workdir:
    jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
    times = [r["step_time_s"] for r in metrics.read_metrics(workdir)
             if "step_time_s" in r and r["step"] >= 3]
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--passes", type=int, default=3, help="CPU timing passes, layouts alternating")
  parser.add_argument("--out", default=HERE)
  args = parser.parse_args()
  study = load_study_config()
  tpu = not targets.available("tpu")
  times = {arg: [] for arg in study.ARGS}
  for k in range(args.passes):  # passes alternate the order: load drifts on a shared host
    for arg in study.ARGS[::1 if k % 2 == 0 else -1]:
      cfg = study.get_config(arg)
      cfg.train.steps = args.steps
      times[arg].append(cpu_step_s(cfg))
      print(arg, f"pass {k}: {times[arg][-1]:.3f} s", flush=True)
  rows = []
  for arg in study.ARGS:
    s, r, m = study.parse(arg)
    cfg = study.get_config(arg)
    row = {"layout": arg, "stages": s, "repeats": r, "microbatches": m,
           "iterations": pipeline.iterations(s, r, m) if s > 1 else 1,
           "bubble": pipeline.bubble(s, r, m) if s > 1 else 0.0,
           "formula": (s - 1) / (r * m + s - 1), "cpu_step_s": statistics.median(times[arg]),
           "cpu_step_s_passes": times[arg]}
    if tpu:
      report = compile_for(cfg, TARGET, arg)
      row.update(tpu_total_gib=report.memory["total"] / GIB, tpu_temp_gib=report.memory["temp"] / GIB,
                 tpu_tflop=report.flops / 1e12,
                 tpu_stage_mib=sum(v for k, v in report.collectives.items()
                                   if k.split()[0] == "stage") / MIB)
    rows.append(row)
    print(json.dumps(row), flush=True)
  base = rows[0]
  lines = [f"| layout | T | bubble (schedule) | (S-1)/(RM+S-1) | CPU step s | x S1 | T/(MR) | "
           f"TPU MiB/device | TPU TFLOP/device | x S1 | stage MiB sent |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    work = row["iterations"] / (row["microbatches"] * row["repeats"]) if row["stages"] > 1 else 1.0
    tpu = (f"{row['tpu_total_gib'] * 1024:.1f} | {row['tpu_tflop']:.4f} | "
           f"{row['tpu_tflop'] / base['tpu_tflop']:.2f} | {row['tpu_stage_mib']:.1f}"
           if "tpu_tflop" in row else "- | - | - | -")
    lines.append(f"| {row['layout']} | {row['iterations']} | {row['bubble']:.3f} | "
                 f"{row['formula']:.3f} | {row['cpu_step_s']:.3f} | "
                 f"{row['cpu_step_s'] / base['cpu_step_s']:.2f} | {work:.2f} | {tpu} |")
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "target": TARGET,
          "steps": args.steps, "passes": args.passes, "cpu": os.cpu_count(),
          "load": os.getloadavg()}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
