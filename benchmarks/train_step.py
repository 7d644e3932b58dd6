"""Train-step throughput and MFU against the matmul peak measured in the same run.

  python benchmarks/train_step.py [--steps 10] [--configs tiny,small_20m] [--batch_size N]
                                  [--set model.n_layers=4 ...] [--vary model.attention=xla,pallas]
                                  [--energy] [--record]

For each config: the jitted train step (the loop's own), `steps` timed steps after 2 warm-up steps,
median step time -> tokens/s and MFU = model FLOPs/s / measured peak. Peak = median of 2048^3 f32
matmuls, measured before and after the configs (the machine is shared: both are reported).
`--set KEY=VALUE` overrides a config key in every config, typed as `--config.KEY=VALUE` is (a
shortened model: fewer layers, a shorter sequence). `--vary KEY=V1,V2` times each config once
per value, in this one process (one row each, labelled `config KEY=V`). `--energy` adds the NVML
board energy of the timed steps (train/goodput.py's meter: joules per token and mean watts; "-"
where there is no NVML).
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
from jaxtrain.train import goodput  # noqa: E402


def time_config(name: str, steps: int, batch_size: int = 0, overrides: dict | None = None,
                energy: bool = False) -> dict:
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  if batch_size:
    cfg.train.batch_size = batch_size
  config_files.apply_overrides(cfg, overrides or {})
  return time_cfg(name, cfg, steps, energy)


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


def time_cfg(name: str, cfg, steps: int, energy: bool = False) -> dict:
  """Median step time of `cfg`'s jitted train step on one device, and what follows from it; with
  `energy`, the NVML energy of the timed steps (None off NVIDIA GPUs or without nvidia-ml-py)."""
  stepper = Stepper(cfg)
  meter = goodput.gpu_energy_meter() if energy else None
  start = time.perf_counter()
  step_time = float(np.median([stepper.step() for _ in range(steps)]))
  result = {"config": name, **stepper.sizes, "tokens_per_step": stepper.tokens,
            "step_time_s": step_time, "tokens_per_sec": stepper.tokens / step_time}
  if meter is not None:
    meter.stop()
    joules = meter.joules()
    result.update(energy_j=joules, joules_per_token=joules / (steps * stepper.tokens),
                  power_w=joules / (time.perf_counter() - start))
  return result


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
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config key in every config (repeatable), e.g. model.n_layers=4")
  parser.add_argument("--vary", default="", metavar="KEY=V1,V2",
                      help="time each config once per value of this config key")
  parser.add_argument("--energy", action="store_true",
                      help="NVML energy of the timed steps (NVIDIA GPUs)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()
  if any("=" not in item for item in args.set):
    parser.error("--set takes KEY=VALUE")
  overrides = dict(item.split("=", 1) for item in args.set)
  if args.vary and "=" not in args.vary:
    parser.error("--vary takes KEY=V1,V2")
  vary_key, _, values = args.vary.partition("=")
  variants = ([(f" {vary_key}={v}", {vary_key: v}) for v in values.split(",")] if args.vary
              else [("", {})])
  peak_before = metrics.measure_matmul_peak()
  results = []
  for name in args.configs.split(","):
    for label, extra in variants:
      try:
        results.append(time_config(name, args.steps, args.batch_size, {**overrides, **extra},
                                   args.energy))
      except Exception as e:  # one variant that does not compile or run costs its row only
        print(f"{name}{label}: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
        first_line = str(e).splitlines()[0][:120]
        results.append({"config": name, "error": f"{type(e).__name__}: {first_line}"})
      results[-1]["config"] += label
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
      f"{f' --batch_size {args.batch_size}' if args.batch_size else ''}"
      f"{''.join(f' --set {item}' for item in args.set)}"
      f"{f' --vary {args.vary}' if args.vary else ''}"
      f"{' --energy' if args.energy else ''}`",
      f"- f32 matmul peak (2048^3, median of 7): {peak_before / 1e9:.1f} GFLOP/s before, "
      f"{peak_after / 1e9:.1f} after; MFU uses " + ("the higher" if jax.default_backend() == "cpu" else
                                                     f"the datasheet's bf16 peak, {peak / 1e12:.0f} TFLOP/s"),
      "",
      "| config | params | tokens/step | step (median) | tokens/s | model GFLOP/s | MFU |"
      + (" energy/token | board W |" if args.energy else ""),
      "|---|---|---|---|---|---|---|" + ("---|---|" if args.energy else ""),
  ]
  for r in results:
    if "error" in r:
      lines.append(f"| {r['config']} | failed: {r['error']} |")
      continue
    achieved = r["flops_per_step"] / r["step_time_s"]
    lines.append(f"| {r['config']} | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} | {r['step_time_s'] * 1e3:.0f} ms "
                 f"| {r['tokens_per_sec']:,.0f} | {achieved / 1e9:.1f} | {achieved / peak:.1%} |"
                 + (energy_cells(r) if args.energy else ""))
  publish(lines, args.record)


def energy_cells(r: dict) -> str:
  """' energy per token | watts |' cells of a result, '-' without NVML."""
  if "energy_j" not in r:
    return " - | - |"
  return f" {r['joules_per_token'] * 1e3:.3f} mJ | {r['power_w']:.0f} |"


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
