"""Pre-trains a tiny byte-level model on the addition language (jaxtrain/posttrain/exact.py) and measures
greedy exact-match accuracy on held-out prompts at every saved step. One JSON line per measurement.

  python experiments/posttrain/pretrain_exact.py --out runs/posttrain/exact_n0.2 --noise 0.2 [--forward]

Not a test: minutes on a CPU. The numbers it printed are in experiments/posttrain/README.md.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

import jaxtrain
from jaxtrain.posttrain import exact

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_config(data_path: str, steps: int, every: int, seed: int):
  """config.py's, with the run's length, checkpoint period and seed."""
  spec = importlib.util.spec_from_file_location("posttrain_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(data_path)
  c.train.update(steps=steps, seed=seed)
  c.optim.update(warmup_steps=min(50, steps // 10))
  c.checkpoint.update(every_steps=every, keep_every_steps=every)
  return c


_JITTED = {}


def _jitted(fn):
  """One jit per function, so evaluating several steps compiles each prompt length once."""
  import jax
  return _JITTED.setdefault(fn, jax.jit(fn, static_argnums=(0, 4, 5, 6)))


def completer(workdir: str, step: int, temperature: float = 0.0, seed: int = 0, max_new_tokens: int = 6):
  """prompts -> completions by the run's params at `step` (greedy at temperature 0, else sampled from
  the whole vocabulary), cut at EOS."""
  import jax
  import jax.numpy as jnp

  from jaxtrain.checkpoint import pretrained
  from jaxtrain.data.text import ByteTokenizer
  from jaxtrain.model import ModelConfig, Transformer, generate

  cfg, params, extra = pretrained.read_step(workdir, step)
  params = {k: v for k, v in params.items() if k != "value_head"}  # a PPO run's value head: not the decoder's
  model = Transformer(ModelConfig.from_config(cfg.model))
  gen = _jitted(generate)
  tok = ByteTokenizer()

  def complete(prompts):
    out = [None] * len(prompts)
    by_length = {}
    for i, p in enumerate(prompts):
      by_length.setdefault(len(p.encode()), []).append(i)
    for length, idx in sorted(by_length.items()):  # generate takes equal-length prompts: a batch per length
      ids = np.array([np.concatenate([[tok.bos], tok.encode(prompts[i])]) for i in idx], np.int32)
      key = jax.random.fold_in(jax.random.key(seed), length)
      new = np.asarray(gen(model, params, jnp.asarray(ids), key, max_new_tokens, float(temperature), 0, extra))
      for i, row in zip(idx, new):
        row = list(row)
        out[i] = tok.decode(row[:row.index(tok.eos)] if tok.eos in row else row)
    return out

  return complete


def measure(workdir: str, step: int, prompts, answers, samples: int) -> dict:
  """Greedy accuracy (all, and by operand digits), and at temperature 1: mean accuracy and pass@samples."""
  greedy = completer(workdir, step)(prompts)
  right = np.array([exact.parse_completion(c) == a for c, a in zip(greedy, answers)])
  kinds = np.array(["%d+%d" % tuple(len(str(x)) for x in exact.parse_prompt(p)) for p in prompts])
  row = {"step": step, "greedy_accuracy": round(float(right.mean()), 4)}
  row.update({f"greedy_{k}": round(float(right[kinds == k].mean()), 4) for k in sorted(set(kinds))})
  if samples:
    hits = np.array([[exact.parse_completion(c) == a for c, a in zip(completer(workdir, step, 1.0, s)(prompts), answers)]
                     for s in range(samples)])
    row.update({"sampled_accuracy_T1": round(float(hits.mean()), 4),
                f"pass_at_{samples}_T1": round(float(hits.any(axis=0).mean()), 4)})
  return row


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--noise", type=float, default=0.0)
  p.add_argument("--forward", action="store_true", help="answers most significant digit first (default: reversed)")
  p.add_argument("--steps", type=int, default=800)
  p.add_argument("--every", type=int, default=200)
  p.add_argument("--n_pretrain", type=int, default=100_000)
  p.add_argument("--n_eval", type=int, default=500)
  p.add_argument("--samples", type=int, default=8, help="sampled completions per prompt at temperature 1")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval_only", action="store_true", help="measure the saved steps of an earlier run")
  a = p.parse_args()
  data_dir, workdir = os.path.join(a.out, "data"), os.path.join(a.out, "run")
  if a.eval_only:
    paths = {"eval": os.path.join(data_dir, exact.FILES["eval"])}
  else:
    paths = exact.write_dataset(data_dir, a.n_pretrain, 500, 500, a.n_eval, a.noise, a.seed, reverse=not a.forward)
    t0 = time.time()
    jaxtrain.train(tiny_config(paths["pretrain"], a.steps, a.every, a.seed), workdir, progress=False, start_over=True)
    print(json.dumps({"train_s": round(time.time() - t0, 1)}), flush=True)
  rows = exact.read_jsonl(paths["eval"])
  prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
  losses = {r["step"]: r["loss"] for r in jaxtrain.read_metrics(workdir, as_frame=False) if "loss" in r}
  for step in range(a.every, a.steps + 1, a.every):
    row = {"noise": a.noise, "reverse": not a.forward, "eval_prompts": len(prompts), "loss": losses.get(step)}
    print(json.dumps({**row, **measure(workdir, step, prompts, answers, a.samples)}), flush=True)


if __name__ == "__main__":
  sys.exit(main())
