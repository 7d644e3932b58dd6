"""MoE throughput per active FLOP: dense vs coarse (8 experts, top-2) vs fine-grained experts at the
same active size, and the collectives of the expert-parallel step.

  python benchmarks/moe.py [--steps 3] [--rounds 3] [--record] [--no_hlo] [--scale] [--only 1,2]

Timing: each variant's jitted train step on one device (the loop's own), compiled and warmed up
first, then `rounds` rounds in which every variant runs `steps` steps in turn (a slow spell of a
shared machine then hits every variant alike); the median of its steps. MFU counts active
parameters only, against the matmul peak measured in the same run. Collectives: the moe_tiny train
step compiled for 2 data x 4 expert virtual CPU devices (in a subprocess, which needs XLA_FLAGS set
before jax starts); every all-to-all and all-gather of the optimized HLO is listed with its operand
size, next to the size of the batch's activations and of one layer's expert weights.
"""

import argparse
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = [  # label, config arg, model overrides
    ("dense (tiny, d_ff 384)", None, dict(n_experts=0)),
    ("coarse: 8 experts x 192 top-2, capacity 1.25", None, dict(capacity_factor=1.25)),
    ("fine: 32 experts x 48 top-8, capacity 1.25", "fine", dict(capacity_factor=1.25)),
    ("fine: 64 experts x 48 top-8, capacity 1.25", "fine", dict(n_experts=64, capacity_factor=1.25)),
    ("coarse, dropless (tiles)", None, dict(dispatch="dropless", grouped_matmul="tiles")),
    ("fine 32/8, dropless (tiles)", "fine", dict(dispatch="dropless", grouped_matmul="tiles")),
    ("fine 64/8, dropless (tiles)", "fine", dict(n_experts=64, dispatch="dropless", grouped_matmul="tiles")),
    ("coarse, dropless (ragged_dot)", None, dict(dispatch="dropless", grouped_matmul="ragged_dot")),
    ("fine 32/8, dropless (ragged_dot)", "fine", dict(dispatch="dropless", grouped_matmul="ragged_dot")),
]


DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def _bytes(shape_text: str) -> tuple[int, str]:
  """Bytes of an HLO result shape (a tuple counts all its parts), and the shape without layouts."""
  parts = re.findall(r"(\w+)\[([\d,]*)\]", shape_text)
  total = sum(DTYPE_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for t, dims in parts)
  return total, " + ".join(f"{t}[{dims}]" for t, dims in parts[:4]) + (" + ..." if len(parts) > 4 else "")


def hlo_collectives() -> list[str]:
  """Runs in a subprocess with 8 virtual devices: the EP step's all-to-alls and all-gathers."""
  from jaxtrain import config_files, data, parallel
  from jaxtrain import builder
  from jaxtrain.core import state as state_lib
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
  cfg.mesh.update(data=2, expert=4, rules="fsdp_ep")
  mesh, task, tx, schedule = builder.build(cfg)
  state, shardings = state_lib.create_state(task, tx, 0, mesh, cfg.mesh.rules)
  feed = parallel.Feed(cfg.train.batch_size, parallel.batch_sharding(mesh))
  with parallel.activate(mesh, cfg.mesh.rules):
    train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
    text = train_fn.lower(state, feed.batch(data.make_source(cfg, "train"), 0)).compile().as_text()
  m, b, l = cfg.model, cfg.train.batch_size, cfg.train.seq_len
  lines = [f"activations [B, L, D] = [{b}, {l}, {m.d_model}] f32 = {b * l * m.d_model * 4 / 1024:.0f} KiB globally; "
           f"one layer's expert weights 3 x [E, D, F] = 3 x [{m.n_experts}, {m.d_model}, {m.d_ff_expert}] f32 = "
           f"{3 * m.n_experts * m.d_model * m.d_ff_expert * 4 / 1024:.0f} KiB"]
  for op in ("all-to-all", "all-gather", "reduce-scatter", "all-reduce"):
    ops = [_bytes(shape) for shape in re.findall(rf"= (\([^)]*\)|\S+) {op}(?:-start)?\(", text)]
    lines.append(f"{op}: {len(ops)} ops" + (f", {sum(b for b, _ in ops) / 1024:.0f} KiB in all, the largest "
                                             f"{max(ops)[1]} = {max(ops)[0] / 1024:.0f} KiB" if ops else ""))
  return lines


# A size where an accelerator is busy (--scale): d 1024, 4 layers, 16 x 1024 tokens, bf16; dense d_ff 4096,
# coarse 8 experts x 2048 top-2, fine 32 x 512 top-8 and 64 x 512 top-8: the same active size.
SCALED = dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, n_layers=4, d_ff=4096, max_seq_len=1024,
              compute_dtype="bfloat16", vocab_size=32768, capacity_factor=1.25)
SCALED_VARIANTS = [
    ("dense, d_ff 4096", dict(n_experts=0)),
    ("coarse: 8 experts x 2048 top-2, capacity 1.25", dict(n_experts=8, top_k=2, d_ff_expert=2048)),
    ("fine: 32 experts x 512 top-8, capacity 1.25", dict(n_experts=32, top_k=8, d_ff_expert=512)),
    ("fine: 64 experts x 512 top-8, capacity 1.25", dict(n_experts=64, top_k=8, d_ff_expert=512)),
    ("coarse, dropless (tiles)", dict(n_experts=8, top_k=2, d_ff_expert=2048, dispatch="dropless",
                                      grouped_matmul="tiles")),
    ("fine 32/8, dropless (tiles)", dict(n_experts=32, top_k=8, d_ff_expert=512, dispatch="dropless",
                                         grouped_matmul="tiles")),
    ("coarse, dropless (ragged_dot)", dict(n_experts=8, top_k=2, d_ff_expert=2048, dispatch="dropless",
                                           grouped_matmul="ragged_dot")),
    ("fine 32/8, dropless (ragged_dot)", dict(n_experts=32, top_k=8, d_ff_expert=512, dispatch="dropless",
                                              grouped_matmul="ragged_dot")),
]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=3, help="steps per variant and round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--only", default="", help="comma-separated indices of the variants to run")
  parser.add_argument("--record", action="store_true")
  parser.add_argument("--no_hlo", action="store_true")
  parser.add_argument("--scale", action="store_true", help="d 1024 / 16 x 1024 tokens / bf16 (accelerators)")
  parser.add_argument("--hlo_only", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.hlo_only:
    print("\n".join(hlo_collectives()))
    return

  import jax
  from benchmarks.train_step import Stepper, machine_lines, publish
  from jaxtrain import config_files, metrics
  peak_before = metrics.measure_matmul_peak()
  variants = [(label, None, {**SCALED, **o}) for label, o in SCALED_VARIANTS] if args.scale else VARIANTS
  if args.only:
    variants = [variants[int(i)] for i in args.only.split(",")]
  steppers = []
  for label, arg, overrides in variants:
    cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py") + (f":{arg}" if arg else ""))
    cfg.model.update(overrides)
    if args.scale:
      cfg.train.update(batch_size=16, seq_len=1024)
      cfg.data.update(symbols=2000, max_symbols=200, stop_prob=1 / 64)
    steppers.append((label, Stepper(cfg)))
    print(f"compiled {label}", flush=True)
  times = {label: [] for label, _ in steppers}
  for _ in range(args.rounds):  # rounds in turn: a slow spell of a shared machine hits every variant
    for label, stepper in steppers:
      times[label] += [stepper.step() for _ in range(args.steps)]
      print(f"  {label}: {np.median(times[label]) * 1e3:.1f} ms so far", flush=True)
  results = []
  for label, stepper in steppers:
    step_time = float(np.median(times[label]))
    results.append((label, {**stepper.sizes, "step_time_s": step_time,
                            "tokens_per_sec": stepper.tokens / step_time}))
    print(f"{label}: step {step_time * 1e3:.1f} ms, {stepper.tokens / step_time:,.0f} tokens/s", flush=True)
  peak = max(peak_before, metrics.measure_matmul_peak())
  if jax.default_backend() != "cpu":
    peak = metrics.peak_flops("bfloat16")[0]
  coarse = next(r for label, r in results if label.startswith("coarse"))
  lines = [
      "### MoE: dense vs coarse vs fine-grained experts at equal active size", "",
      *machine_lines(),
      f"- command: `python benchmarks/moe.py --steps {args.steps} --rounds {args.rounds}"
      f"{' --scale' if args.scale else ''}`; medians of {args.rounds} rounds x {args.steps} steps, the variants "
      f"timed in turn each round (compiled and warmed up first), one device, "
      + ("batch 16 x 1024 tokens, d 1024, 4 layers, bf16" if args.scale else "batch 32 x 128 tokens (moe_tiny)") +
      "; MFU on active parameters vs " + (f"the f32 matmul peak {peak / 1e9:.1f} GFLOP/s measured in the same run"
                                           if jax.default_backend() == "cpu" else
                                           f"the datasheet bf16 peak {peak / 1e12:.0f} TFLOP/s"), "",
      "| variant | params | active | step | tokens/s | active MFU | time per active FLOP vs coarse |",
      "|---|---|---|---|---|---|---|",
  ]
  for label, r in results:
    achieved = r["flops_per_step"] / r["step_time_s"]
    per_flop = (r["step_time_s"] / r["flops_per_step"]) / (coarse["step_time_s"] / coarse["flops_per_step"])
    lines.append(f"| {label} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M "
                 f"| {r['step_time_s'] * 1e3:.0f} ms | {r['tokens_per_sec']:,.0f} | {achieved / peak:.1%} "
                 f"| {per_flop:.2f}x |")
  if not args.no_hlo:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__, "--hlo_only"], env=env, capture_output=True, text=True,
                         check=True).stdout
    lines += ["", "Collectives of the moe_tiny train step on 2 data x 4 expert (fsdp_ep), optimized HLO:", "",
              *[f"- {line}" for line in out.strip().splitlines()]]
  publish(lines, args.record)


if __name__ == "__main__":
  main()
