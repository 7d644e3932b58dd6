"""MoE layer forward + backward: coarse (8 experts, top-2) vs fine-grained (64 experts, top-8) experts at
the same active size, dropless vs capacity dispatch, side by side with a dense SwiGLU of that size.

  python benchmarks/moe_dispatch.py [--batch 4 --length 256 --d-model 128 --active-ff 512]
                                    [--repeats 7] [--dtype float32|bfloat16]

Each row: median time of the jitted value-and-grad of one layer (after 2 warm-ups), and its ratio to
the dense SwiGLU with d_ff = active-ff (same FLOPs per token as top_k experts of active_ff / top_k each),
timed in the same run. One device, no mesh. Prints a table; records nothing.
"""

import argparse
import dataclasses
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxtrain.model.mlp import Mlp  # noqa: E402
from jaxtrain.model.moe import MoeMlp  # noqa: E402
from jaxtrain.model.transformer import ModelConfig  # noqa: E402


def median_time(module, x, repeats):
  """Median seconds of jit(value_and_grad) of sum(y^2) (+ MoE losses) w.r.t. params and x."""
  params = jax.jit(module.init)(jax.random.key(0), x)

  def loss(params, x):
    out = module.apply(params, x)
    y, extra = out if isinstance(out, tuple) else (out, {"aux_loss": 0.0, "z_loss": 0.0})
    return jnp.mean(jnp.square(y.astype(jnp.float32))) + extra["aux_loss"] + extra["z_loss"]

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  times = []
  for _ in range(repeats + 2):
    t = time.perf_counter()
    jax.block_until_ready(step(params, x))
    times.append(time.perf_counter() - t)
  return float(np.median(times[2:]))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--length", type=int, default=256)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--active-ff", type=int, default=512)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--capacity-factor", type=float, default=1.25)
  args = p.parse_args()
  dtype = jnp.dtype(args.dtype)
  base = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                     d_ff=args.active_ff, max_seq_len=args.length, compute_dtype=dtype,
                     capacity_factor=args.capacity_factor)
  x = jax.random.normal(jax.random.key(1), (args.batch, args.length, args.d_model), dtype)
  tokens = args.batch * args.length
  flops = 3 * 6 * tokens * args.d_model * args.active_ff  # fwd + bwd of 3 matmuls, active experts only

  dense = median_time(Mlp(base), x, args.repeats)
  rows = [("dense SwiGLU", "-", dense)]
  for experts, top_k in ((8, 2), (64, 8)):
    for dispatch in ("dropless", "capacity"):
      cfg = dataclasses.replace(base, n_experts=experts, top_k=top_k, d_ff_expert=args.active_ff // top_k,
                                dispatch=dispatch)
      rows.append((f"{experts} experts top-{top_k} (F={cfg.expert_d_ff})", dispatch,
                   median_time(MoeMlp(cfg), x, args.repeats)))

  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
        f"python {platform.python_version()}")
  print(f"command: python benchmarks/moe_dispatch.py --batch {args.batch} --length {args.length} "
        f"--d-model {args.d_model} --active-ff {args.active_ff} --repeats {args.repeats} --dtype {args.dtype}")
  print(f"{tokens} tokens, d_model {args.d_model}, active d_ff {args.active_ff}, capacity factor "
        f"{args.capacity_factor}; median of {args.repeats} fwd+bwd after 2 warm-ups")
  print()
  print("| layer | dispatch | fwd+bwd (median) | x dense | active GFLOP/s |")
  print("|---|---|---|---|---|")
  for name, dispatch, t in rows:
    print(f"| {name} | {dispatch} | {t * 1e3:.2f} ms | {t / dense:.2f} | {flops / t / 1e9:.1f} |")


if __name__ == "__main__":
  main()
