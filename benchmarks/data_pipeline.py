"""Data pipeline throughput against what the train step consumes, and prepare against the tokenizer.

  python benchmarks/data_pipeline.py [--record]

Side by side, in one run:
1. pipeline: tokens/s of batches from text_tiny's prepared cache (the standard library's top-level
   .py files; grain: shuffle, pack, batch, prefetch), against the tokens/s the tiny train step
   consumes (jitted step, median of 10);
2. prepare: tokens/s of `prepare` with every core against the `tokenizers` library's encode called
   in a loop over the same documents, with a byte-level BPE (2048) trained on text_tiny's corpus;
   corpus: every .py file of the standard library tree (site-packages excluded), copied to a temp dir.
"""

import argparse
import datetime
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step  # noqa: E402

from jaxtrain import config_files, data  # noqa: E402
from jaxtrain.data import prepare as prepare_lib, tokenizers  # noqa: E402


def pipeline_tokens_per_sec(cfg, workdir, batches=200) -> float:
  it = data.make_iterator(cfg, "train", 0, cfg.train.batch_size, workdir)
  next(it)
  t = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches * cfg.train.batch_size * cfg.train.seq_len / (time.perf_counter() - t)


def step_tokens_per_sec(cfg, workdir) -> float:
  import jax
  from jaxtrain import parallel
  from jaxtrain import builder
  from jaxtrain.core import state as state_lib
  cfg.mesh.data = 1
  mesh, task, tx, schedule = builder.build(cfg, workdir, jax.devices()[:1])
  state, shardings = state_lib.create_state(task, tx, 0, mesh, cfg.mesh.rules)
  feed = parallel.Feed(cfg.train.batch_size, parallel.batch_sharding(mesh))
  batch = feed.put(next(data.make_iterator(cfg, "train", 0, cfg.train.batch_size, workdir)))
  with parallel.activate(mesh, cfg.mesh.rules):
    train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
    times = []
    for _ in range(12):
      t = time.perf_counter()
      state, m = train_fn(state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t)
  return cfg.train.batch_size * cfg.train.seq_len / float(np.median(times[2:]))


def direct_tokens_per_sec(cfg, tokenizer) -> float:
  texts = list(prepare_lib.corpus_texts(cfg))
  t = time.perf_counter()
  n = sum(len(tokenizer.encode(x)) for x in texts)
  return n / (time.perf_counter() - t)


def prepare_tokens_per_sec(cfg, workdir, tokenizer) -> float:
  shutil.rmtree(os.path.join(workdir, "data_cache"), ignore_errors=True)
  t = time.perf_counter()
  report = prepare_lib.prepare(cfg, workdir, tokenizer, progress=False)
  return report["tokens"] / (time.perf_counter() - t)


def _not_py(folder, names):
  """copytree filter: keep .py files and package folders, drop site-packages and caches."""
  return [n for n in names if n in ("site-packages", "__pycache__") or
          (not n.endswith(".py") and not os.path.isdir(os.path.join(folder, n)))]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()
  workdir = tempfile.mkdtemp(prefix="jaxtrain_bench_")
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "text_tiny.py"))
  cfg.data.prepare_workers = 0
  rows = []
  byte = tokenizers.make_tokenizer(cfg.data, workdir)
  prepare_tokens_per_sec(cfg, workdir, byte)  # the cache the pipeline reads
  pipe = pipeline_tokens_per_sec(cfg, workdir)
  step = step_tokens_per_sec(cfg, workdir)
  bpe_cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "text_tiny.py"))
  bpe_cfg.data.update(tokenizer="bpe", bpe_vocab_size=2048)
  bpe = tokenizers.make_tokenizer(bpe_cfg.data, workdir, texts=prepare_lib.corpus_texts(bpe_cfg))
  shutil.copytree(sysconfig.get_paths()["stdlib"], os.path.join(workdir, "stdlib"), ignore=_not_py)
  bpe_cfg.data.path = os.path.join(workdir, "stdlib", "**", "*.py")
  rows.append(("bpe-2048, stdlib tree", prepare_tokens_per_sec(bpe_cfg, workdir, bpe),
               direct_tokens_per_sec(bpe_cfg, bpe)))
  shutil.rmtree(workdir, ignore_errors=True)

  lines = [f"### Data pipeline vs train step; prepare vs tokenizer ({datetime.date.today()})", "",
           *train_step.machine_lines(), "- command: `python benchmarks/data_pipeline.py`",
           "- corpus: text_tiny's default (Python stdlib *.py), seq_len 128, batch 32", "",
           "| pipeline tokens/s | tiny train step tokens/s | ratio (target >= 10x) |", "|---|---|---|",
           f"| {pipe:,.0f} | {step:,.0f} | {pipe / step:.1f}x |", "",
           f"| tokenizer, corpus | prepare tokens/s ({os.cpu_count()} workers) | encode loop tokens/s | ratio (target >= 0.8x) |",
           "|---|---|---|---|"]
  lines += [f"| {name} | {p:,.0f} | {d:,.0f} | {p / d:.2f}x |" for name, p, d in rows]
  train_step.publish(lines, args.record)


if __name__ == "__main__":
  main()
