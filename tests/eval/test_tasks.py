"""Task files (eval/tasks.py): acc and acc_norm as lm-evaluation-harness computes them, perplexity
and bits-per-byte against a direct computation, few-shot contexts, and one-line errors naming file
and line."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain.data.tokenizers import Bytes
from jaxtrain.eval import evaluate, score, tasks
from jaxtrain.model import ModelConfig, Transformer
from tests.eval.conftest import write_jsonl
from tests.fixtures import tiny_config

SEQ_LEN = 32


@pytest.fixture(scope="module")
def byte_model():
  """A random float32 byte-level model (vocab 260, max_seq_len 32), its params and a Scorer."""
  cfg = ModelConfig.from_config(tiny_config(model={"vocab_size": 260}).model)
  module = Transformer(cfg)
  params = jax.tree.map(np.asarray, nn.unbox(
      jax.jit(module.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]))
  return cfg, module, params, score.Scorer(cfg, params, rows=4)


def test_acc_norm_flips_the_choice_when_length_normalisation_does(tmp_path, byte_model):
  """Among random strings, a short choice with the higher total log-likelihood and a long one with
  the higher per-character log-likelihood: acc picks the short one, acc_norm the long (gold) one."""
  cfg, _, params, scorer = byte_model
  context, rng = "Pick one:", np.random.default_rng(0)
  candidates = ["".join(rng.choice(list("abcdefgh"), int(n))) for n in rng.integers(1, 7, 40)]
  lls = [s.logprob for s in scorer.loglikelihood([tasks.encode_pair(Bytes(), context, " " + c)
                                                   for c in candidates])]
  pair = next((s, l) for s in range(40) for l in range(40)
              if len(candidates[l]) > len(candidates[s]) and lls[s] > lls[l]
              and lls[s] / len(candidates[s]) < lls[l] / len(candidates[l]))
  short, long = (candidates[i] for i in pair)
  path = write_jsonl(tmp_path / "flip.jsonl",
                     [{"query": context, "choices": [short, long], "gold": 1}])
  got = evaluate(params, [path], config=cfg, tokenizer=Bytes())["flip"]
  assert (got["acc"], got["acc_norm"], got["docs"], got["truncated"]) == (0.0, 1.0, 1, 0)


def test_perplexity_and_bits_per_byte_match_a_direct_computation(tmp_path, byte_model):
  """One text shorter than the model (one forward pass after BOS) and one of three windows, each
  window run alone; word and byte perplexity and bits per byte by lm-eval's formulas."""
  cfg, module, params, _ = byte_model
  texts = ["the cat sat", "a much longer text that needs three windows of 32 bytes, or even more  "]
  bos = Bytes().bos

  def window_logprob(context, continuation):
    full = np.concatenate([context, continuation]).astype(np.int32)
    logits_LV = np.asarray(jax.jit(module.apply)({"params": params}, full[None, :-1]),
                           np.float64)[0]
    logp_LV = logits_LV - np.log(np.exp(logits_LV).sum(-1, keepdims=True))
    n = len(continuation)
    return logp_LV[np.arange(len(full) - 1)[-n:], full[1:][-n:]].sum()

  ids = [Bytes().encode(t) for t in texts]
  assert len(ids[0]) < SEQ_LEN and 2 * SEQ_LEN < len(ids[1]) <= 3 * SEQ_LEN
  total = window_logprob([bos], ids[0])
  total += window_logprob([bos], ids[1][:SEQ_LEN])
  total += window_logprob(ids[1][SEQ_LEN - 1:SEQ_LEN], ids[1][SEQ_LEN:2 * SEQ_LEN])
  total += window_logprob(ids[1][2 * SEQ_LEN - 1:2 * SEQ_LEN], ids[1][2 * SEQ_LEN:])
  path = write_jsonl(tmp_path / "wiki.jsonl", [{"text": t} for t in texts])
  got = evaluate(params, path, config=cfg, tokenizer=Bytes(), num_fewshot=3)["wiki"]
  # lm-eval: len(re.split(r"\s+", text)): 14 words, and the trailing spaces add an empty one
  words = 3 + 15
  n_bytes = sum(len(t) for t in texts)
  assert got["docs"] == 2
  assert got["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-5)
  assert got["byte_perplexity"] == pytest.approx(math.exp(-total / n_bytes), rel=1e-5)
  assert got["bits_per_byte"] == pytest.approx(-total / n_bytes / math.log(2), rel=1e-5)


def test_fewshot_contexts_are_seeded_solved_examples_without_the_doc_itself(tmp_path):
  docs = [{"context": f"Q{i}:", "choices": ["no", "yes"], "gold": i % 2} for i in range(6)]
  task = tasks.load_task(write_jsonl(tmp_path / "qa.jsonl", docs))
  shots = tasks.fewshot_contexts(task, 2, seed=3)
  assert shots == tasks.fewshot_contexts(task, 2, seed=3) != tasks.fewshot_contexts(task, 2, seed=4)
  for i, ctx in enumerate(shots):
    parts = ctx.split("\n\n")
    assert len(parts) == 3 and parts[-1] == f"Q{i}:"
    for part in parts[:2]:
      j = int(part[1:part.index(":")])
      assert j != i and part == f"Q{j}: {['no', 'yes'][j % 2]}"
  header = {"task": {"target_delimiter": "=", "fewshot_delimiter": "|",
                     "fewshot_file": "shots.jsonl"}}
  write_jsonl(tmp_path / "shots.jsonl", [{"query": "S:", "choices": ["x"], "gold": 0}])
  task = tasks.load_task(write_jsonl(tmp_path / "qa2.jsonl", [header, *docs[:2]]))
  assert tasks.fewshot_contexts(task, 1, seed=0) == ["S:=x|Q0:", "S:=x|Q1:"]
  with pytest.raises(config_lib.ConfigError, match="needs 2 few-shot docs, has 1"):
    tasks.fewshot_contexts(task, 2, seed=0)


def test_encode_pair_moves_the_contexts_trailing_space_to_the_continuation():
  request = tasks.encode_pair(Bytes(), "Answer: ", "yes")
  assert list(request.context) == [Bytes().bos, *b"Answer:"]
  assert list(request.continuation) == list(b" yes")


GOOD = {"context": "Q:", "choices": ["a", "b"], "gold": 0}
BAD_LINES = [
    ("{not json", "2: not JSON"),
    ('["a", "list"]', "2: expected a JSON object, got list"),
    (json.dumps({"choices": ["a"], "gold": 0}),
     "2: multiple_choice: needs a string field 'context'"),
    (json.dumps({"context": "Q:", "choices": [], "gold": 0}),
     "2: multiple_choice: 'choices' must be a non-empty"),
    (json.dumps({"context": "Q:", "choices": ["a", 3], "gold": 0}),
     "2: multiple_choice: every choice"),
    (json.dumps({"context": "Q:", "choices": ["a", "b"], "gold": 2}),
     r"2: multiple_choice: 'gold' must be an integer in \[0, 2\), got 2"),
    (json.dumps({"context": "Q:", "choices": ["a", "b"], "gold": True}),
     "2: multiple_choice: 'gold' must be"),
    (json.dumps({"context": "Q:", "choices": ["a", "b"]}), "2: multiple_choice: 'gold' must be"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_bad_line_is_one_error_line_naming_file_and_line(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
  with pytest.raises(config_lib.ConfigError, match=f"^{path}:{message}") as e:
    tasks.load_task(str(path))
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("lines, message", [
    ([], "no records"),
    ([{"question": "?"}], "1: cannot tell the task kind"),
    ([{"task": {"kind": "essay"}}, GOOD], "1: task kind 'essay' is not one of"),
    ([{"task": {"delimiter": " "}}, GOOD],
     "1: the header's 'delimiter' is not an option of a multiple_choice task"),
    ([{"task": {"target_delimiter": 1}}, GOOD],
     "1: the header's 'target_delimiter' must be a string"),
    ([{"task": {"kind": "perplexity"}}, GOOD],
     "2: perplexity: needs a non-empty string field 'text'"),
])
def test_bad_files_are_one_error_line(tmp_path, lines, message):
  path = write_jsonl(tmp_path / "bad.jsonl", lines)
  with pytest.raises(config_lib.ConfigError, match=f"^{path}:? ?{message}") as e:
    tasks.load_task(path)
  assert "\n" not in str(e.value)
