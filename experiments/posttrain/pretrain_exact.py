"""Pre-trains a tiny byte-level model on the addition language (jaxtrain/posttrain/exact.py) and measures
greedy exact-match accuracy on held-out prompts at every saved step. One JSON line per measurement.

  python experiments/posttrain/pretrain_exact.py --out runs/exact --noise 0.0 --steps 1200

Not a test: minutes on a CPU. The numbers it printed are in experiments/posttrain/README.md.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

import jaxtrain
from jaxtrain.posttrain import exact


def tiny_config(data_path: str, steps: int, every: int, seed: int):
  c = jaxtrain.default_config()
  c.model.update(vocab_size=264, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=64, scan_layers=False)
  c.data.update(kind="text", path=data_path, tokenizer="byte", eval_fraction=0.02, packing="first_fit")
  c.train.update(steps=steps, batch_size=32, seq_len=64, log_every=50, eval_every=0, seed=seed)
  c.optim.update(lr=3e-3, warmup_steps=min(50, steps // 10), schedule="cosine")
  c.checkpoint.update(every_steps=every, keep=1, keep_every_steps=every)
  return c


_JITTED = {}


def _jitted(fn):
  """One jit per function, so evaluating several steps compiles each prompt length once."""
  import jax
  return _JITTED.setdefault(fn, jax.jit(fn, static_argnums=(0, 4, 5, 6)))


def greedy_completer(workdir: str, step: int, max_new_tokens: int = 6):
  """prompts -> completions by greedy decoding of the run's params at `step`, cut at EOS."""
  import jax
  import jax.numpy as jnp

  from jaxtrain.checkpoint import pretrained
  from jaxtrain.data.text import ByteTokenizer
  from jaxtrain.model import ModelConfig, Transformer, generate

  cfg, params, extra = pretrained.read_step(workdir, step)
  model = Transformer(ModelConfig.from_config(cfg.model))
  gen = _jitted(generate)
  tok = ByteTokenizer()

  def complete(prompts):
    out = [None] * len(prompts)
    by_length = {}
    for i, p in enumerate(prompts):
      by_length.setdefault(len(p.encode()), []).append(i)
    for idx in by_length.values():  # generate takes equal-length prompts: one batch per length
      ids = np.array([np.concatenate([[tok.bos], tok.encode(prompts[i])]) for i in idx], np.int32)
      new = np.asarray(gen(model, params, jnp.asarray(ids), jax.random.key(0), max_new_tokens, 0.0, 0, extra))
      for i, row in zip(idx, new):
        row = list(row)
        out[i] = tok.decode(row[:row.index(tok.eos)] if tok.eos in row else row)
    return out

  return complete


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--noise", type=float, default=0.0)
  p.add_argument("--reverse", action="store_true")
  p.add_argument("--steps", type=int, default=1200)
  p.add_argument("--every", type=int, default=300)
  p.add_argument("--n_pretrain", type=int, default=100_000)
  p.add_argument("--n_eval", type=int, default=500)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args()
  data_dir = os.path.join(a.out, "data")
  paths = exact.write_dataset(data_dir, a.n_pretrain, 500, 500, a.n_eval, a.noise, a.seed, reverse=a.reverse)
  workdir = os.path.join(a.out, "run")
  cfg = tiny_config(paths["pretrain"], a.steps, a.every, a.seed)
  t0 = time.time()
  final = jaxtrain.train(cfg, workdir, progress=False)
  train_s = time.time() - t0
  rows = exact.read_jsonl(paths["eval"])
  prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
  for step in range(a.every, a.steps + 1, a.every):
    acc = exact.accuracy(greedy_completer(workdir, step), prompts, answers)
    print(json.dumps({"noise": a.noise, "reverse": a.reverse, "step": step, "eval_prompts": len(prompts),
                      "greedy_accuracy": round(acc, 4), "train_s_total": round(train_s, 1),
                      "final_loss": round(float(final.get("loss", float("nan"))), 4)}), flush=True)


if __name__ == "__main__":
  sys.exit(main())
