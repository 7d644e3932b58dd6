"""Train-step throughput and MFU against the matmul peak measured in the same run.

  python benchmarks/train_step.py [--steps 10] [--configs tiny,small_20m] [--record]

For each config: the jitted train step (the loop's own), `steps` timed steps after 2 warm-up steps,
median step time -> tokens/s and MFU = model FLOPs/s / measured peak. Peak = median of 2048^3 f32
matmuls, measured before and after the configs (the machine is shared: both are reported).
`--record` appends the table to benchmarks/RESULTS.md.
"""

import argparse
import datetime
import os
import platform
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxtrain import config_files, data, metrics, parallel  # noqa: E402
from jaxtrain.model import param_count  # noqa: E402
from jaxtrain import builder  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402


def time_config(name: str, steps: int, batch_size: int = 0) -> dict:
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  if batch_size:
    cfg.train.batch_size = batch_size
  return time_cfg(name, cfg, steps)


class Stepper:
  """`cfg`'s jitted train step (the loop's own) on one device, compiled and warmed up (2 steps);
  each `step()` takes the next batch and returns the seconds until its metrics are on the host."""

  def __init__(self, cfg):
    cfg.mesh.update(data=1, fsdp=1, expert=1, tensor=1)
    mesh, task, tx, schedule = builder.build(cfg, "", jax.devices()[:1])
    self.state, shardings = state_lib.create_state(task, tx, 0, mesh, cfg.mesh.rules)
    feed, source = parallel.Feed(cfg.train.batch_size, parallel.batch_sharding(mesh)), data.make_source(cfg, "train")
    self._batches = lambda index: feed.batch(source, index)
    self._context = lambda: parallel.activate(mesh, cfg.mesh.rules)
    with self._context():
      self._train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
    self._next = 0
    self.tokens = cfg.train.batch_size * cfg.train.seq_len
    self.sizes = {"params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params)),
                  "active_params": param_count(task.model.cfg, active=True),
                  "flops_per_step": task.flops_per_token * self.tokens}
    for _ in range(2):
      self.step()

  def step(self) -> float:
    batch = self._batches(self._next)
    self._next += 1
    with self._context():
      t = time.perf_counter()
      self.state, step_metrics = self._train_fn(self.state, batch)
      jax.block_until_ready(step_metrics)
      return time.perf_counter() - t


def time_cfg(name: str, cfg, steps: int) -> dict:
  """Median step time of `cfg`'s jitted train step on one device, and what follows from it."""
  stepper = Stepper(cfg)
  step_time = float(np.median([stepper.step() for _ in range(steps)]))
  return {"config": name, **stepper.sizes, "tokens_per_step": stepper.tokens, "step_time_s": step_time,
          "tokens_per_sec": stepper.tokens / step_time}


def cpu_name() -> str:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--configs", default="tiny,small_20m")
  parser.add_argument("--batch_size", type=int, default=0, help="override train.batch_size (0: the config's)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()
  peak_before = metrics.measure_matmul_peak()
  results = [time_config(name, args.steps, args.batch_size) for name in args.configs.split(",")]
  peak_after = metrics.measure_matmul_peak()
  peak = max(peak_before, peak_after)
  if jax.default_backend() != "cpu":  # accelerators: MFU against the datasheet's dense bf16 peak
    peak, source = metrics.peak_flops("bfloat16")
    bf16 = metrics.measure_matmul_peak(n=8192, dtype=jax.numpy.bfloat16)
    print(f"{jax.devices()[0].device_kind}: datasheet bf16 peak {peak / 1e12:.0f} TFLOP/s ({source}); "
          f"measured 8192^3 bf16 matmul {bf16 / 1e12:.0f} TFLOP/s")
  lines = [
      f"### Train step vs measured matmul peak ({datetime.date.today()})",
      "",
      *machine_lines(),
      f"- command: `python benchmarks/train_step.py --steps {args.steps} --configs {args.configs}"
      f"{f' --batch_size {args.batch_size}' if args.batch_size else ''}`",
      f"- f32 matmul peak (2048^3, median of 7): {peak_before / 1e9:.1f} GFLOP/s before, "
      f"{peak_after / 1e9:.1f} after; MFU uses " + ("the higher" if jax.default_backend() == "cpu" else
                                                     f"the datasheet's bf16 peak, {peak / 1e12:.0f} TFLOP/s"),
      "",
      "| config | params | tokens/step | step (median) | tokens/s | model GFLOP/s | MFU |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in results:
    achieved = r["flops_per_step"] / r["step_time_s"]
    lines.append(f"| {r['config']} | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} | {r['step_time_s'] * 1e3:.0f} ms "
                 f"| {r['tokens_per_sec']:,.0f} | {achieved / 1e9:.1f} | {achieved / peak:.1%} |")
  publish(lines, args.record)


def machine_lines() -> list[str]:
  return [f"- hardware: {cpu_name()}, {os.cpu_count()} cores, backend {jax.default_backend()}",
          f"- jax {jax.__version__}, python {platform.python_version()}"]


def publish(lines: list[str], record: bool) -> None:
  """Prints a result table; with `record`, appends it to benchmarks/RESULTS.md."""
  text = "\n".join(lines) + "\n"
  print(text)
  if record:
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write("\n" + text)


if __name__ == "__main__":
  main()
