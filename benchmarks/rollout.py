"""Rollout throughput: the KV-cache sampler (jaxtrain/posttrain/rollout.rollout) vs the naive sampler that
re-runs the full forward over the growing sequence every step (rollout.naive_rollout).

  python benchmarks/rollout.py [--config tiny] [--batch_size 8] [--prompt_len 16] [--new_tokens 128]
                               [--repeats 3] [--record]

Both jitted (sampling settings static) and run once to compile, then timed alternately, `repeats` rounds;
medians -> generated tokens/s (batch x new tokens per call). Prompts have mixed lengths (left-padded);
temperature 1, no stop token, so every row generates all new tokens.
"""

import argparse
import datetime
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step  # noqa: E402

from jaxtrain import config_files  # noqa: E402
from jaxtrain.model import ModelConfig, Transformer  # noqa: E402
from jaxtrain.posttrain import rollout as rollout_lib  # noqa: E402

SAMPLERS = {"rollout": rollout_lib.rollout, "naive": rollout_lib.naive_rollout}


def measure(model_cfg, batch_size: int, prompt_len: int, new_tokens: int, repeats: int) -> dict[str, float]:
  """Median seconds per call of each sampler, after one compiling call each."""
  model = Transformer(ModelConfig.from_config(model_cfg))
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
  rng = np.random.default_rng(0)
  lens = rng.integers(prompt_len // 2, prompt_len + 1, batch_size)
  prompts = rng.integers(1, model.cfg.vocab_size, (batch_size, prompt_len)) * (
      np.arange(prompt_len) >= prompt_len - lens[:, None])
  args = (params, jnp.asarray(prompts, jnp.int32), jnp.asarray(lens, jnp.int32))
  fns = {name: jax.jit(fn, static_argnames=rollout_lib.STATIC_ARGNAMES) for name, fn in SAMPLERS.items()}
  call = lambda name, seed: jax.block_until_ready(fns[name](model, *args, jax.random.key(seed), new_tokens,
                                                             temperature=1.0))
  for name in fns:
    call(name, 0)  # compile
  times = {name: [] for name in fns}
  for i in range(repeats):  # alternate: both see the same load of the shared machine
    for name in fns:
      start = time.perf_counter()
      call(name, i + 1)
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="tiny")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{args.config}.py"))
  t = measure(cfg.model, args.batch_size, args.prompt_len, args.new_tokens, args.repeats)
  tokens = args.batch_size * args.new_tokens
  m = cfg.model
  lines = [
      f"### Rollouts: KV-cache sampler vs naive full-forward sampler ({datetime.date.today()})",
      "",
      *train_step.machine_lines(),
      f"- command: `python benchmarks/rollout.py --config {args.config} --batch_size {args.batch_size} "
      f"--prompt_len {args.prompt_len} --new_tokens {args.new_tokens} --repeats {args.repeats}`",
      f"- model of configs/{args.config}.py (d_model {m.d_model}, {m.n_layers} layers, vocab {m.vocab_size}, "
      f"max_seq_len {m.max_seq_len}); prompts of {args.prompt_len} slots, mixed lengths, left-padded; "
      f"temperature 1; medians of {args.repeats} alternating calls after one compiling call each",
      "",
      "| sampler | s per call | generated tokens/s | vs naive |",
      "|---|---|---|---|",
      *(f"| {name} | {t[name]:.3f} | {tokens / t[name]:,.0f} | {t['naive'] / t[name]:.1f}x |" for name in SAMPLERS),
  ]
  train_step.publish(lines, args.record)


if __name__ == "__main__":
  main()
