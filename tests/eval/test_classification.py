"""Classification tasks (eval/tasks.py): the predicted label is the argmax of log-likelihoods
computed by a plain forward pass; acc and macro-F1 (eval/metrics.py) as scikit-learn's
f1_score(average="macro"), checked by hand; label errors are one line."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.data.tokenizers import Bytes
from jaxtrain.eval import evaluate, metrics
from jaxtrain.model import ModelConfig, Transformer
from tests.eval.conftest import assert_bad_task_file, write_jsonl
from tests.fixtures import tiny_config

LABELS = ["yes", "no", "maybe"]


def test_macro_f1_by_hand():
  # a: tp 2, fp 0, fn 1 -> 4/5; b: tp 1, fp 1, fn 1 -> 1/2; c: tp 1, fp 1, fn 0 -> 2/3
  gold, pred = list("aaabbc"), list("aabbcc")
  assert metrics.macro_f1(gold, pred) == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
  # a label only predicted counts (F1 0); a label neither gold nor predicted is not averaged in
  assert metrics.macro_f1(["a", "a"], ["a", "b"]) == pytest.approx((2 / 3 + 0) / 2)
  assert metrics.macro_f1(["a", "b"], ["a", "b"]) == 1.0


APPLY = jax.jit(lambda module, params, tokens_1L: module.apply({"params": params}, tokens_1L),
                static_argnums=0)


def loglikelihood(module, params, context: str, continuation: str) -> float:
  """Sum of log-probs of the continuation's bytes after BOS + context, one plain forward pass (right
  padding to 32 slots cannot reach back through causal attention)."""
  ctx, cont = Bytes().encode(context), Bytes().encode(continuation)
  full = np.concatenate([[256], ctx, cont]).astype(np.int32)
  tokens_1L = np.zeros((1, 32), np.int32)
  tokens_1L[0, :len(full) - 1] = full[:-1]
  logits = np.asarray(APPLY(module, params, tokens_1L)[0], np.float64)[:len(full) - 1]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  slots = np.arange(len(full) - 1)[-len(cont):]
  return float(logp[slots, full[1:][-len(cont):]].sum())


def test_classification_acc_and_macro_f1_against_a_direct_computation(tmp_path):
  cfg = ModelConfig.from_config(tiny_config(model={"vocab_size": 260}).model)
  module = Transformer(cfg)
  params = jax.tree.map(np.asarray, nn.unbox(
      jax.jit(module.init)(jax.random.key(5), jnp.zeros((1, 8), jnp.int32))["params"]))
  contexts = ["Is it raining?", "Answer:", "Do cats fly", "Sky is blue", "Two is even", "Maybe not"]
  predicted = [LABELS[int(np.argmax([loglikelihood(module, params, c, " " + label)
                                     for label in LABELS]))]
               for c in contexts]
  gold = ["yes", "no", "no", "maybe", predicted[4], "yes"]
  header = {"task": {"kind": "classification", "labels": LABELS}}
  path = write_jsonl(tmp_path / "cls.jsonl",
                     [header, *[{"context": c, "label": g} for c, g in zip(contexts, gold)]])
  got = evaluate(params, [path], config=cfg, tokenizer=Bytes())["cls"]
  acc = np.mean([p == g for p, g in zip(predicted, gold)])
  assert got["acc"] == pytest.approx(acc) and 0 < acc < 1
  assert got["macro_f1"] == pytest.approx(metrics.macro_f1(gold, predicted))
  assert (got["docs"], got["truncated"]) == (6, 0)


@pytest.mark.parametrize("lines, message", [
    ([{"task": {"kind": "classification", "labels": []}}, {"context": "a", "label": "x"}],
     "1: the header's 'labels' must be a non-empty list of distinct non-empty strings"),
    ([{"task": {"kind": "classification", "labels": ["x", "x"]}}, {"context": "a", "label": "x"}],
     "1: the header's 'labels' must be a non-empty list"),
    ([{"context": "a", "label": "x"}], "1: classification: the header needs 'labels'"),
    ([{"task": {"labels": ["x", "y"]}}, {"context": "a", "label": "x"},
      {"context": "b", "label": "z"}],
     "3: classification: label 'z' is not one of the header's labels"),
    ([{"task": {"labels": ["x"]}}, {"context": "a", "label": 1}],
     "2: classification: needs a string field 'label'"),
])
def test_bad_labels_are_one_error_line(tmp_path, lines, message):
  assert_bad_task_file(tmp_path, lines, message)
