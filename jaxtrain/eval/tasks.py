"""Evaluation tasks from local JSONL files, scored as lm-evaluation-harness scores them.

A task file holds one JSON object a line, optionally after a header line {"task": {...}} with
`kind`, `target_delimiter` (default " "), `fewshot_delimiter` (default "\\n\\n") and `fewshot_file`
(a JSONL of the same kind, relative to the task file). Without `kind`, the first record decides:
  multiple_choice  {"context" (or "query"): str, "choices": [str, ...], "gold": int}: `acc` is the
                   argmax of the choices' log-likelihoods, `acc_norm` the argmax of log-likelihood
                   divided by the choice's length in characters; the continuation is
                   target_delimiter + choice.
  perplexity       {"text": str}: word_perplexity, byte_perplexity, bits_per_byte of the rolling
                   log-likelihood (score.rolling_requests).
  classification   {"context": str, "label": str} with header `labels` (the label set): the label
                   of highest log-likelihood (target_delimiter + label); acc and macro_f1.
  generate         {"context": str, "answer": str}: exact_match of the answer extracted from the
                   generation (metrics.extract_answer; header answer_regex).
  code             {"prompt": str, "tests": str, "entry_point"?: str}: pass@k over header `n`
                   samples run with their tests in the sandbox (eval/sandbox.py).
  dialogue         {"messages": [{"role", "content"}, ...] (the last the user's), "reference": str}:
                   exact_match and token f1 of the reply through the chat template; with header
                   `reward_model` (a train.task=rm run's workdir) also its reward of the reply,
                   of the reference, and the reply's win rate over the reference.
Generation options in the header (eval/generate.py): until (stop strings; default ["\\n\\n"], code
HumanEval's, dialogue none: EOS), max_new_tokens (256), temperature (0: greedy), top_k (0), n (1),
k ([1]), timeout_s (5), memory_mb (512) for code.
Contexts start with the tokenizer's BOS (as jaxtrain trains documents; lm-eval's HF backend with
add_bos_token=True), and a context's trailing whitespace moves to the continuation (lm-eval's
_encode_pair). A bad line is one ConfigError line naming the file and line. An lm-evaluation-harness
task YAML over local files loads too (eval/task_yaml.py); small tasks of each kind ship in SHIPPED.
"""

import dataclasses
import math
import os
import random
import re

import numpy as np

from jaxtrain import config as config_lib
from jaxtrain.eval import kinds, metrics, score
from jaxtrain.eval.kinds import KINDS, OPTIONS, Task, read_jsonl


_error = kinds.error
# the small tasks shipped with the package, one of each kind (tools/make_eval_tasks.py writes them)
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks_data")


def _read_docs(path: str, kind: str | None, fewshot: bool = False) -> tuple[dict, str, list]:
  """(options, kind, checked docs) of a task file (a few-shot file needs no labels)."""
  lines = read_jsonl(path)
  header, header_line = {}, 1
  if lines and isinstance(lines[0][1], dict) and set(lines[0][1]) == {"task"}:
    header_line, first = lines.pop(0)
    header = first["task"]
    if not isinstance(header, dict):
      raise _error(path, header_line, "the header's 'task' must be an object")
    kind = header.get("kind", kind)
    if kind is not None and kind not in KINDS:
      raise _error(path, header_line, f"task kind {kind!r} is not one of {KINDS}")
  if not lines:
    raise config_lib.ConfigError(f"{path}: no records")
  kind = kind or kinds.kind_of(path, *lines[0])
  opts = kinds.options(path, header_line, header, kind, fewshot)
  docs = [kinds.check_doc(path, n, doc, kind) for n, doc in lines]
  for (n, _), doc in zip(lines, docs):
    if kind == "classification" and opts["labels"] and doc["label"] not in opts["labels"]:
      raise _error(path, n, f"classification: label {doc['label']!r} is not one of the header's "
                            f"labels {opts['labels']}")
  return {**header, **opts}, kind, docs


def load_tasks(tasks, what: str) -> list[Task]:
  """Task files (paths) and Tasks, loaded and checked; their names must differ (`what` says who
  asks, in the one-line error)."""
  loaded = [t if isinstance(t, Task) else load_task(os.fspath(t)) for t in tasks]
  names = [t.name for t in loaded]
  if len(set(names)) != len(names):
    raise config_lib.ConfigError(f"{what}: two tasks share a name: {names}")
  return loaded


def load_task(path: str) -> Task:
  """A task file (and its few-shot file) read and checked; ConfigError (one line) otherwise. A .yaml
  or .yml file is an lm-evaluation-harness task over local JSON Lines (eval/task_yaml.py)."""
  if path.endswith((".yaml", ".yml")):
    from jaxtrain.eval import task_yaml
    return task_yaml.load_task(path)
  header, kind, docs = _read_docs(path, None)
  fewshot = None
  if "fewshot_file" in header:
    fewshot_path = os.path.join(os.path.dirname(path), header["fewshot_file"])
    fewshot = _read_docs(fewshot_path, kind, fewshot=True)[2]
  name = os.path.splitext(os.path.basename(path))[0]
  return Task(name, path, kind, docs, fewshot, header.get("target_delimiter", " "),
              header.get("fewshot_delimiter", "\n\n"),
              {k: v for k, v in header.items() if k in OPTIONS})


def fewshot_contexts(task: Task, num_fewshot: int | None, seed: int) -> list[str]:
  """Each doc's context: its description (a YAML task's), then `num_fewshot` solved examples (text,
  target delimiter, gold choice; None: the task's own count), each followed by fewshot_delimiter,
  then the doc's text, as lm-evaluation-harness builds it (ConfigurableTask.fewshot_context). The
  examples come from the few-shot pool (a few-shot file or split, else the docs themselves): the
  first n in order (sampler first_n), or drawn by one random.Random(seed) doc after doc (lm-eval's
  ContextSampler: n drawn, or n + 1 and the doc itself dropped where the pool holds it)."""
  n = task.num_fewshot if num_fewshot is None else num_fewshot
  described = lambda doc: doc.get("description", "")
  if n == 0:
    return [described(d) + d["context"] for d in task.docs]
  pool = task.fewshot_docs if task.fewshot_docs is not None else task.docs
  own = task.fewshot_docs is None if task.exclude_doc is None else task.exclude_doc
  if len(pool) < n + own:
    raise config_lib.ConfigError(
        f"{task.path}: num_fewshot={n} needs {n + own} few-shot docs, has {len(pool)}")
  rng, out = random.Random(seed), []
  for doc in task.docs:
    if task.sampler == "first_n":
      shots = [s for s in pool if not (own and s == doc)][:n]
    elif own:
      shots = [pool[j] for j in rng.sample(range(len(pool)), n + 1) if pool[j] != doc][:n]
      if len(shots) < n:  # the pool holds copies of the doc: draw again without any of them
        others = [s for s in pool if s != doc]
        shots = [others[j] for j in rng.sample(range(len(others)), n)]
    else:
      shots = [pool[j] for j in rng.sample(range(len(pool)), n)]
    examples = "".join(s["context"] + task.target_delimiter + _target(s) + task.fewshot_delimiter
                       for s in shots)
    out.append(described(doc) + examples + doc["context"])
  return out


def _target(doc: dict) -> str:
  """A solved few-shot example's answer."""
  return doc["choices"][doc["gold"]] if "choices" in doc else doc.get("label", doc.get("answer"))


def encode_pair(tokenizer, context: str, continuation: str) -> score.Request:
  """lm-eval's _encode_pair after BOS: trailing whitespace of the context moves to the continuation,
  whose ids are those of context + continuation past the context's."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  try:
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
  except ValueError as e:  # text outside a synthetic language's symbols
    raise config_lib.ConfigError(f"cannot tokenize {context + continuation!r}: {e}") from None
  bos = np.array([tokenizer.bos], np.int32)
  return score.Request(np.concatenate([bos, ctx]).astype(np.int32),
                       np.asarray(whole[len(ctx):], np.int32))


def _stderr(values) -> float:
  """The standard error of the mean (lm-eval's sample stderr)."""
  values = np.asarray(values, np.float64)
  return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def multiple_choice(task: Task, scorer: score.Scorer, tokenizer, num_fewshot: int,
                    seed: int) -> dict:
  """acc and acc_norm (with standard errors), docs, and requests truncated from the left."""
  contexts = fewshot_contexts(task, num_fewshot, seed)
  requests = [encode_pair(tokenizer, ctx, task.target_delimiter + c)
              for ctx, doc in zip(contexts, task.docs) for c in doc["choices"]]
  scores = iter(scorer.loglikelihood(requests))
  acc, acc_norm, truncated = [], [], 0
  for doc in task.docs:
    doc_scores = [next(scores) for _ in doc["choices"]]
    lls = np.array([s.logprob for s in doc_scores])
    lengths = np.array([float(len(c)) for c in doc["choices"]])
    acc.append(float(np.argmax(lls) == doc["gold"]))
    acc_norm.append(float(np.argmax(lls / lengths) == doc["gold"]))
    truncated += sum(s.truncated > 0 for s in doc_scores)
  return {"acc": float(np.mean(acc)), "acc_stderr": _stderr(acc),
          "acc_norm": float(np.mean(acc_norm)), "acc_norm_stderr": _stderr(acc_norm),
          "docs": len(task.docs), "truncated": int(truncated)}


def classification(task: Task, scorer: score.Scorer, tokenizer, num_fewshot: int,
                   seed: int) -> dict:
  """acc and macro_f1 (metrics.macro_f1) of the label of highest log-likelihood."""
  labels = task.options["labels"]
  contexts = fewshot_contexts(task, num_fewshot, seed)
  scores = scorer.loglikelihood([encode_pair(tokenizer, ctx, task.target_delimiter + label)
                                 for ctx in contexts for label in labels])
  lls = np.array([s.logprob for s in scores]).reshape(len(contexts), len(labels))
  predicted = [labels[i] for i in np.argmax(lls, axis=1)]
  gold = [doc["label"] for doc in task.docs]
  acc = [float(p == g) for p, g in zip(predicted, gold)]
  return {"acc": float(np.mean(acc)), "acc_stderr": _stderr(acc),
          "macro_f1": metrics.macro_f1(gold, predicted), "docs": len(task.docs),
          "truncated": int(sum(s.truncated > 0 for s in scores))}


def perplexity(task: Task, scorer: score.Scorer, tokenizer) -> dict:
  """lm-eval's word_perplexity, byte_perplexity and bits_per_byte of the texts' summed rolling
  log-likelihood: exp(-LL / words), exp(-LL / UTF-8 bytes), -LL / bytes / ln 2."""
  texts = [doc["text"] for doc in task.docs]
  lls = scorer.rolling_loglikelihood([tokenizer.encode(t) for t in texts], tokenizer.bos)
  total = sum(lls)
  words = sum(len(re.split(r"\s+", t)) for t in texts)
  n_bytes = sum(len(t.encode("utf-8")) for t in texts)
  return {"word_perplexity": math.exp(-total / words),
          "byte_perplexity": math.exp(-total / n_bytes),
          "bits_per_byte": -total / n_bytes / math.log(2), "docs": len(texts)}


def run(task: Task, scorer: score.Scorer, tokenizer, num_fewshot: int | None = None, seed: int = 0,
        limit: int | None = None) -> dict:
  """The task's metrics on its first `limit` docs (all with None); perplexity, code and dialogue
  tasks take no few-shot examples (num_fewshot ignored, as lm-eval's rolling tasks)."""
  if limit is not None:  # the few-shot pool stays whole, as lm-eval's
    own = task.fewshot_docs is None if task.exclude_doc is None else task.exclude_doc
    task = dataclasses.replace(task, docs=task.docs[:limit],
                               fewshot_docs=task.fewshot_docs or task.docs, exclude_doc=own)
  if task.kind == "perplexity":
    return perplexity(task, scorer, tokenizer)
  if task.kind == "classification":
    return classification(task, scorer, tokenizer, num_fewshot, seed)
  if task.kind == "multiple_choice":
    return multiple_choice(task, scorer, tokenizer, num_fewshot, seed)
  from jaxtrain.eval import generate
  gen = generate.Generator(scorer)
  if task.kind == "generate":
    return generate.generate_task(task, gen, tokenizer, fewshot_contexts(task, num_fewshot, seed),
                                  seed)
  return (generate.code_task if task.kind == "code" else generate.dialogue_task)(
      task, gen, tokenizer, seed)
