"""Compiled temporaries of gpt2_small's loss + gradient at 8 x 1024 (CPU compile, nothing run): full vs fused
(chunked) cross-entropy, by attention implementation, key block and remat; `--body_only` replaces the head and
loss by a sum of squares of the hidden states (what the rest of the step holds).

  python benchmarks/step_memory.py --variants blockwise:full:256,blockwise:full:512 [--body_only]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxtrain import config_files  # noqa: E402
from jaxtrain.core.lm import LanguageModel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def temp_gib(cross_entropy: str, attention: str, remat: str, block: int, body_only: bool = False) -> float:
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "gpt2_small.py"))
  cfg.train.update(batch_size=8, cross_entropy=cross_entropy)
  cfg.model.update(remat=remat, attention=attention, attention_block=block)
  task = LanguageModel(cfg, "")
  params = nn.unbox(jax.eval_shape(task.init, jax.random.key(0))[0])
  tokens = jax.ShapeDtypeStruct((8, cfg.train.seq_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens, "positions": tokens,
           "loss_mask": jax.ShapeDtypeStruct(tokens.shape, jnp.float32)}
  if body_only:
    def f(p, x):
      hidden = task.model.apply({"params": p}, x["inputs"], x["positions"], x["segment_ids"], return_hidden=True)
      hidden = hidden[0] if isinstance(hidden, tuple) else hidden
      return jnp.sum(jnp.square(hidden.astype(jnp.float32)))
  else:
    f = lambda p, x: task.loss(p, x, {}, {})[0]
  compiled = jax.jit(jax.value_and_grad(f)).lower(params, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**30


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variants", default="xla:none:512,xla:full:512,blockwise:full:512,blockwise:full:256",
                  help="attention:remat:attention_block, comma separated")
  ap.add_argument("--body_only", action="store_true")
  args = ap.parse_args()
  print("| attention | remat | block | full | chunked | full / chunked |\n|---|---|---|---|---|---|")
  for variant in args.variants.split(","):
    attention, remat, block = variant.split(":")
    t0 = time.time()
    if args.body_only:
      print(f"| {attention} | {remat} | {block} | body only: {temp_gib('full', attention, remat, int(block), True):.3f} "
            f"GiB | | |", flush=True)
      continue
    full = temp_gib("full", attention, remat, int(block))
    chunked = temp_gib("chunked", attention, remat, int(block))
    print(f"| {attention} | {remat} | {block} | {full:.2f} GiB | {chunked:.2f} GiB | {full / chunked:.2f}x | "
          f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
