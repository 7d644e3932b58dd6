"""Train-step throughput of attention implementations side by side: model.attention=blockwise vs xla.

  python benchmarks/attention_impls.py [--config small_20m] [--lengths 256,1024,4096] [--steps 3]
                                       [--batch_size 1] [--record]

For each length: both steps compiled and warmed up (train_step.Stepper), then timed alternately, `steps`
rounds; median step time -> tokens/s. The crossover sets `CPU_BLOCKWISE_FROM` in jaxtrain/model/attention.py.
"""

import argparse
import datetime
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step  # noqa: E402

from jaxtrain import config_files  # noqa: E402

IMPLEMENTATIONS = ("xla", "blockwise")


def time_length(name: str, length: int, steps: int, batch_size: int) -> dict[str, float]:
  """Median seconds per train step of each implementation at `length` tokens per row."""
  steppers = {}
  for impl in IMPLEMENTATIONS:
    cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    cfg.model.update(attention=impl, max_seq_len=max(length, cfg.model.max_seq_len))
    cfg.train.update(seq_len=length, batch_size=batch_size)
    steppers[impl] = train_step.Stepper(cfg)
  times = {impl: [] for impl in IMPLEMENTATIONS}
  for _ in range(steps):  # alternate: both see the same load of the shared machine
    for impl, stepper in steppers.items():
      times[impl].append(stepper.step())
  return {impl: float(np.median(t)) for impl, t in times.items()}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="small_20m")
  parser.add_argument("--lengths", default="256,1024,4096")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch_size", type=int, default=1)
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()
  lines = [
      f"### Attention implementations: blockwise vs xla train step ({datetime.date.today()})",
      "",
      *train_step.machine_lines(),
      f"- command: `python benchmarks/attention_impls.py --config {args.config} --lengths {args.lengths} "
      f"--steps {args.steps} --batch_size {args.batch_size}`",
      f"- {args.config}, batch {args.batch_size}, model.attention_block=512 (default); medians of {args.steps} "
      f"alternating steps after 2 warm-up steps each",
      "",
      "| seq len | xla step | blockwise step | xla tokens/s | blockwise tokens/s | blockwise / xla |",
      "|---|---|---|---|---|---|",
  ]
  for length in (int(x) for x in args.lengths.split(",")):
    t = time_length(args.config, length, args.steps, args.batch_size)
    tokens = length * args.batch_size
    lines.append(f"| {length} | {t['xla'] * 1e3:.0f} ms | {t['blockwise'] * 1e3:.0f} ms | {tokens / t['xla']:,.0f} "
                 f"| {tokens / t['blockwise']:,.0f} | {t['xla'] / t['blockwise']:.2f}x |")
    print(lines[-1], flush=True)
  train_step.publish(lines, args.record)


if __name__ == "__main__":
  main()
