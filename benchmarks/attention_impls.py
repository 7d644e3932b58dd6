"""Train-step throughput of attention implementations side by side: model.attention=blockwise vs
xla.

  python benchmarks/attention_impls.py [--config small_20m] [--lengths 256,1024,4096] [--steps 3]
                                       [--batch_size 1] [--impls xla,blockwise] [--op] [--record]

For each length: the steps of each implementation compiled and warmed up (train_step.Stepper),
then timed alternately, `steps` rounds; median step time -> tokens/s. The crossover sets
`CPU_BLOCKWISE_FROM` in jaxtrain/model/attention.py. A train step's batches are packed (segment
ids), so there cudnn runs as pallas (`attention.choose`).

`--op`: the attention op alone instead, forward + backward of model/attention.IMPLEMENTATIONS[impl]
jitted, at the config's heads, kv heads, head dim and compute dtype, on unpacked rows (one document
each: the batch cuDNN takes), timed alternately; median -> TFLOP/s of the causal attention's useful
FLOPs (7 B H L^2 K: forward 2 B H L^2 K, backward 2.5 times that). Implementations this backend
does not run are listed as skipped, with `choose`'s reason.
"""

import argparse
import dataclasses
import datetime
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step  # noqa: E402

from jaxtrain import config_files  # noqa: E402
from jaxtrain.config import ConfigError, ModelConfig  # noqa: E402
from jaxtrain.model import attention  # noqa: E402

IMPLEMENTATIONS = ("xla", "blockwise")


def time_length(name: str, length: int, steps: int, batch_size: int,
                impls=IMPLEMENTATIONS) -> dict[str, float]:
  """Median seconds per train step of each implementation at `length` tokens per row."""
  steppers = {}
  for impl in impls:
    cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    cfg.model.update(attention=impl, max_seq_len=max(length, cfg.model.max_seq_len))
    cfg.train.update(seq_len=length, batch_size=batch_size)
    steppers[impl] = train_step.Stepper(cfg)
  times = {impl: [] for impl in impls}
  for _ in range(steps):  # alternate: all see the same load of the shared machine
    for impl, stepper in steppers.items():
      times[impl].append(stepper.step())
  return {impl: float(np.median(t)) for impl, t in times.items()}


def op_timer(model_cfg, impl: str, length: int, batch_size: int):
  """A function that runs one forward + backward of `impl` on fixed unpacked inputs and returns
  its seconds (compiled and run once first); or, a string, why this backend does not run `impl`."""
  cfg = dataclasses.replace(model_cfg, attention=impl)
  try:
    chosen = attention.choose(cfg, length, packed=False, in_order=True)
  except ConfigError as e:
    return str(e)
  if chosen != impl:
    return f"choose runs {chosen} here"
  b, h, g, kd = batch_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (b, length, heads, kd), jnp.dtype(cfg.compute_dtype))
             for key, heads in zip(keys, (h, g, g)))
  dout = jax.random.normal(keys[3], q.shape, q.dtype)
  segment = jnp.ones((b, length), jnp.int32)
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  implementation = attention.IMPLEMENTATIONS[impl]

  @jax.jit
  def forward_backward(q, k, v, dout):
    attend = lambda q, k, v: implementation(q, k, v, segment, segment, index, index, cfg)
    out, pull = jax.vjp(attend, q, k, v)
    return out, *pull(dout)

  jax.block_until_ready(forward_backward(q, k, v, dout))

  def run() -> float:
    t = time.perf_counter()
    jax.block_until_ready(forward_backward(q, k, v, dout))
    return time.perf_counter() - t

  return run


def op_rows(m, impls, length: int, batch_size: int, steps: int) -> list[str]:
  """Table rows of each implementation's op at `length`, timed alternately."""
  timers = {impl: op_timer(m, impl, length, batch_size) for impl in impls}
  times = {impl: [] for impl, timer in timers.items() if callable(timer)}
  for _ in range(steps):
    for impl in times:
      times[impl].append(timers[impl]())
  medians = {impl: float(np.median(t)) for impl, t in times.items()}
  flops = 7 * batch_size * m.n_heads * length ** 2 * m.head_dim
  base = medians.get(impls[0])
  rows = []
  for impl in impls:
    if impl not in medians:
      rows.append(f"| {length} | {impl} | skipped: {timers[impl]} | - | - |")
      continue
    ratio = f"{base / medians[impl]:.2f}x" if base else "-"
    rows.append(f"| {length} | {impl} | {medians[impl] * 1e3:.2f} ms "
                f"| {flops / medians[impl] / 1e12:.3g} | {ratio} |")
  return rows


def op_main(args) -> None:
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{args.config}.py"))
  m = ModelConfig.from_config(cfg.model)
  impls = args.impls.split(",")
  lines = [
      f"### Attention op: {', '.join(impls)}, forward + backward ({datetime.date.today()})",
      "",
      *train_step.machine_lines(),
      f"- command: `python benchmarks/attention_impls.py --op --config {args.config} "
      f"--impls {args.impls} --lengths {args.lengths} --steps {args.steps} "
      f"--batch_size {args.batch_size}`",
      f"- {args.config}'s attention: {m.n_heads} heads over {m.n_kv_heads} kv heads of "
      f"{m.head_dim}, {m.compute_dtype}, batch {args.batch_size}, unpacked causal rows, "
      f"attention_block {m.attention_block}; medians of {args.steps} alternating runs after one "
      f"warm-up; TFLOP/s of 7 B H L^2 K",
      "",
      f"| seq len | implementation | forward + backward | TFLOP/s | vs {impls[0]} |",
      "|---|---|---|---|---|",
  ]
  print("\n".join(lines), flush=True)
  for length in (int(x) for x in args.lengths.split(",")):
    rows = op_rows(m, impls, length, args.batch_size, args.steps)
    print("\n".join(rows), flush=True)  # as they come: a later length may not finish in time
    lines += rows
  if args.record:
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write("\n" + "\n".join(lines) + "\n")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="small_20m")
  parser.add_argument("--lengths", default="256,1024,4096")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch_size", type=int, default=1)
  parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                      help="model.attention values to compare; the first is the baseline")
  parser.add_argument("--op", action="store_true",
                      help="time the attention op alone (forward + backward)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()
  if args.op:
    return op_main(args)
  impls = tuple(args.impls.split(","))
  base = impls[0]
  lines = [
      f"### Attention implementations: {' vs '.join(reversed(impls))} train step "
      f"({datetime.date.today()})",
      "",
      *train_step.machine_lines(),
      f"- command: `python benchmarks/attention_impls.py --config {args.config} "
      f"--lengths {args.lengths} --steps {args.steps} --batch_size {args.batch_size}"
      f"{f' --impls {args.impls}' if impls != IMPLEMENTATIONS else ''}`",
      f"- {args.config}, batch {args.batch_size}, model.attention_block=512 (default); medians of "
      f"{args.steps} alternating steps after 2 warm-up steps each",
      "",
      "| seq len | " + " | ".join(f"{i} step" for i in impls) + " | "
      + " | ".join(f"{i} tokens/s" for i in impls) + " | "
      + " | ".join(f"{i} / {base}" for i in impls[1:]) + " |",
      "|---|" + "---|" * (3 * len(impls) - 1),
  ]
  for length in (int(x) for x in args.lengths.split(",")):
    t = time_length(args.config, length, args.steps, args.batch_size, impls)
    tokens = length * args.batch_size
    lines.append(f"| {length} | " + " | ".join(f"{t[i] * 1e3:.0f} ms" for i in impls) + " | "
                 + " | ".join(f"{tokens / t[i]:,.0f}" for i in impls) + " | "
                 + " | ".join(f"{t[base] / t[i]:.2f}x" for i in impls[1:]) + " |")
    print(lines[-1], flush=True)
  train_step.publish(lines, args.record)


if __name__ == "__main__":
  main()
