"""Log-likelihood requests per second: jaxtrain's lm-eval adapter (packed rows, one compiled
program, jaxtrain/eval/adapter.py), with a doc's choices sharing its context and with each request
alone, against lm-evaluation-harness's Hugging Face backend (torch, padded batches), the same
requests on the same random Llama, on this host's CPU (issue 24 item 6).

  python benchmarks/eval_vs_hf.py [--docs 200] [--hidden 256] [--layers 4] [--batch 8] [--rows 8]

A random LlamaForCausalLM (no download) and a byte-level BPE tokenizer are saved to a temporary
directory with a tokenizer_config.json; `docs` generated multiple-choice docs (2-4 choices each, a
one-shot context) give the (context, continuation) requests. Each backend first scores them all
once (jaxtrain compiles, torch warms up), then `repeats` times, in turn, timed (medians); the
log-likelihoods are checked to agree. Prints each rate and its ratio to the HF backend's. Needs
the eval extra (lm-eval, accelerate) and torch.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_model(path: str, hidden: int, layers: int) -> None:
  from tests.checkpoint.test_hf import bpe_tokenizer_json, hf_model
  bpe_tokenizer_json(os.path.join(path, "tokenizer.json"))
  hf_model(tie=False, seed=0, vocab_size=300, hidden_size=hidden, num_hidden_layers=layers,
           num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
           intermediate_size=hidden * 3, max_position_embeddings=256).save_pretrained(
               path, safe_serialization=True)
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "pad_token": "</s>"}, f)


def requests(n_docs: int):
  from lm_eval.api.instance import Instance

  from jaxtrain.eval import tasks
  from tests.eval.conftest import multiple_choice_docs
  docs = multiple_choice_docs(n_docs, seed=1)
  task = tasks.Task("bench", "", "multiple_choice", docs, fewshot_docs=docs)
  contexts = tasks.fewshot_contexts(task, 1, seed=0)
  return [Instance("loglikelihood", doc, (ctx, " " + c), i)
          for i, (ctx, doc) in enumerate(zip(contexts, docs)) for c in doc["choices"]]


def warm_up(lm, reqs):
  """Compile / warm up on all the requests once: jaxtrain's row length and program follow a
  call's requests, so the timed calls (the same requests) then compile nothing."""
  lm.loglikelihood(reqs, disable_tqdm=True)


def timed(lm, reqs):
  start = time.perf_counter()
  out = lm.loglikelihood(reqs, disable_tqdm=True)
  return out, time.perf_counter() - start


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--docs", type=int, default=200)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--batch", type=int, default=8, help="HF batch size (and jaxtrain rows)")
  p.add_argument("--rows", type=int, default=0,
                 help="jaxtrain's packed rows of 256 slots a batch (0: --batch)")
  p.add_argument("--repeats", type=int, default=3, help="timed calls of each, alternating; medians")
  p.add_argument("--threads", type=int, default=0,
                 help="1: both backends on one thread (torch.set_num_threads(1), XLA:CPU without "
                      "its Eigen thread pool), a ratio that a loaded host does not skew; 0: "
                      "each library's default")
  args = p.parse_args()
  rows = args.rows or args.batch
  if args.threads not in (0, 1):
    raise SystemExit("--threads must be 0 or 1")
  if args.threads == 1:  # before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
  for name in ("lm_eval", "lm-eval", "transformers"):
    logging.getLogger(name).setLevel(logging.ERROR)
  import torch
  from lm_eval.models.huggingface import HFLM
  if args.threads == 1:
    torch.set_num_threads(1)

  from jaxtrain.eval.adapter import JaxtrainLM
  with tempfile.TemporaryDirectory() as path:
    build_model(path, args.hidden, args.layers)
    reqs = requests(args.docs)
    hf = HFLM(pretrained=path, add_bos_token=True, dtype="float32", device="cpu",
              batch_size=args.batch)
    backends = {"lm-eval hf backend": hf,
                "jaxtrain, contexts shared": JaxtrainLM(path, rows=rows),
                "jaxtrain, each request alone": JaxtrainLM(path, rows=rows, share_contexts=False)}
    with torch.no_grad():
      for lm in backends.values():
        warm_up(lm, reqs)
      times, scores = {name: [] for name in backends}, {}
      for _ in range(args.repeats):
        for name, lm in backends.items():
          scores[name], seconds = timed(lm, reqs)
          times[name].append(seconds)
  want = scores["lm-eval hf backend"]
  diff = max(abs(a[0] - b[0]) for got in scores.values() for a, b in zip(got, want))
  print(f"{len(reqs)} requests ({args.docs} docs, one-shot), Llama hidden={args.hidden} "
        f"layers={args.layers}, HF batch {args.batch}, jaxtrain rows {rows}, "
        f"torch threads {torch.get_num_threads()}; "
        f"max |loglikelihood difference| {diff:.2e}")
  hf_times = times["lm-eval hf backend"]
  for name, seconds in times.items():
    median = statistics.median(seconds)
    print(f"{name:30s} {len(reqs) / median:8.1f} requests/s ({median:.2f} s), ratio to hf "
          f"{statistics.median(hf_times) / median:.2f}x (each run's: "
          f"{', '.join(f'{h / j:.2f}' for h, j in zip(hf_times, seconds))})")
  if not diff < 1e-3:
    raise SystemExit("the backends disagree")


if __name__ == "__main__":
  main()
