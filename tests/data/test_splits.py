"""Held-out splits: by documents, or a token tail when documents are too few; no leakage, exact resume,
and a one-document corpus that trains with evaluation on (or fails in prepare naming the flag)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import metrics
from jaxtrain.config import default_config
from jaxtrain.data import splits
from jaxtrain.data.cache import write_cache
from jaxtrain.data.pipeline import TextPipeline
from jaxtrain.data.splits import eval_mask
from jaxtrain.data.prepare import prepare
from jaxtrain.data.sources import DataError
from jaxtrain.data.tokenizers import Bytes
from tests.data.test_pipeline import check_batch, first_epoch
from tests.fixtures import ROOT, tiny_config

SEQ, ROWS, N = 16, 4, 1000  # one document of N unique tokens 1..N


@pytest.fixture(scope="module")
def one_doc(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("one_doc"))
  write_cache(path, [np.arange(1, N + 1)], vocab_size=2**16, fingerprint="one_doc")
  return path


def args(path, **kw):
  return {"caches": [path], "weights": None, "seq_len": SEQ, "batch_size": ROWS, "seed": 3, "split": "train",
          "eval_fraction": 0.02, **kw}


def test_split_by_documents_whenever_both_splits_get_a_pair():
  offsets = np.cumsum([0] + list(np.random.default_rng(0).integers(2, 50, 300)))
  s = splits.split(offsets, 0.1, min_eval_tokens=10**9)
  held = eval_mask(300, 0.1)
  np.testing.assert_array_equal(s.eval, np.stack([offsets[:-1], offsets[1:]], 1)[held])
  np.testing.assert_array_equal(s.train, np.stack([offsets[:-1], offsets[1:]], 1)[~held])
  assert s.tail == 0
  assert splits.split(offsets, 0.0, 10).eval.size == 0 and len(splits.split(offsets, 0.0, 10).train) == 300


@pytest.mark.parametrize("tokens, fraction, min_eval, tail", [
    (1000, 0.02, 65, 65),  # one batch of 4 x 16 pairs + 1 > 2% (20)
    (1000, 0.3, 65, 300),  # the fraction when it is more
    (100, 0.02, 65, 50),  # at most half the tokens for the batch minimum
    (4, 0.5, 65, 2),  # the smallest corpus that splits: one pair each
    (3, 0.5, 65, 0)])  # too short: no eval split, the training split keeps everything
def test_one_document_holds_out_its_tail(tokens, fraction, min_eval, tail):
  s = splits.split(np.array([0, tokens]), fraction, min_eval)
  assert s.tail == tail
  if tail:
    assert s.train.tolist() == [[0, tokens - tail]] and s.eval.tolist() == [[tokens - tail, tokens]]
  else:
    assert s.train.tolist() == [[0, tokens]] and s.eval.size == 0


def test_tail_spans_documents_when_the_split_by_documents_starves_one():
  offsets = np.array([0, 1, 2, 42])  # two 1-token documents (no pair) and one of 40 tokens
  s = splits.split(offsets, 0.25, min_eval_tokens=5)
  assert s.tail == 11 and s.train.tolist() == [[0, 1], [1, 2], [2, 31]] and s.eval.tolist() == [[31, 42]]


def test_one_document_splits_without_leakage_and_eval_gets_a_batch(one_doc):
  train = first_epoch(TextPipeline(**args(one_doc)))
  held = first_epoch(TextPipeline(**args(one_doc, split="eval")))
  tail = ROWS * SEQ + 1  # 65 tokens > 2% of 1000
  np.testing.assert_array_equal(held, np.arange(N - tail + 1, N))  # pairs named by their input token
  np.testing.assert_array_equal(train, np.arange(1, N - tail))  # the boundary pair (935, 936) is in neither
  assert np.intersect1d(train, np.arange(N - tail + 1, N + 1)).size == 0  # no eval token is a train input
  b = next(TextPipeline(**args(one_doc)))
  check_batch(b)
  assert (b["targets"][b["segment_ids"] > 0] <= N - tail).all()  # nor is any a train target


def test_one_document_resumes_exactly_and_refuses_another_holdout(one_doc, tmp_path):
  ref = TextPipeline(**args(one_doc))
  want = [next(ref) for _ in range(9)][5:]
  p = TextPipeline(**args(one_doc))
  for _ in range(5):
    next(p)
  state = p.get_state()
  assert state["stream"]["holdout"] == [ROWS * SEQ + 1]
  again = TextPipeline(**args(one_doc))
  again.set_state(state)
  job = [{"pipeline": args(one_doc), "state": state, "batches": 4, "out": str(tmp_path / "fresh")}]
  (tmp_path / "jobs.json").write_text(json.dumps(job))
  run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "data", "pipeline_worker.py"),
                        str(tmp_path / "jobs.json")], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  for i, w in enumerate(want):
    got = next(again)
    for k in w:
      np.testing.assert_array_equal(got[k], w[k])
      np.testing.assert_array_equal(np.load(tmp_path / "fresh" / f"{i}_{k}.npy"), w[k])
  with pytest.raises(ValueError, match="holdout: \\[65\\] -> \\[129\\]"):
    TextPipeline(**args(one_doc, batch_size=2 * ROWS)).set_state(state)


def prepare_cfg(path, **train):
  cfg = default_config()
  cfg.data.update(kind="text", path=str(path), prepare_workers=1)
  cfg.train.update(seq_len=SEQ, batch_size=ROWS, **train)
  return cfg


def test_prepare_names_the_flag_when_no_eval_split_can_be_held_out(tmp_path):
  (tmp_path / "tiny.txt").write_text("x")  # BOS x EOS: 3 tokens, 2 pairs, too few to split
  (tmp_path / "long.txt").write_text("y" * 200)
  for path, changes, fragment in [
      (tmp_path / "tiny.txt", {}, "--config.train.eval_every=0"),
      (tmp_path / "long.txt", {"eval_fraction": 0.0}, "--config.data.eval_fraction=0.05"),
  ]:
    cfg = prepare_cfg(path)
    cfg.data.update(changes)
    with pytest.raises(DataError) as e:
      prepare(cfg, str(tmp_path / "run"), Bytes(), progress=False)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
  assert prepare(prepare_cfg(tmp_path / "tiny.txt", eval_every=0), str(tmp_path / "run"), Bytes(),
                 progress=False)["kept"] == 1


@pytest.mark.slow  # ~27 s on 2 cores: the default suite stays under 10 minutes
def test_one_document_corpus_trains_with_evaluation(tmp_path):
  (tmp_path / "book.txt").write_text("".join(f"line {i}: the quick brown fox. " for i in range(60)))
  cfg = tiny_config(model=dict(vocab_size=264, max_seq_len=32), mesh=dict(data=-1, rules="dp"),
                    train=dict(steps=2, batch_size=8, seq_len=16, eval_every=2, eval_batches=1))
  cfg.data.update(kind="text", path=str(tmp_path / "book.txt"), tokenizer="byte", eval_fraction=0.02)
  final = jaxtrain.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1], progress=False)
  rows = metrics.read_metrics(str(tmp_path / "run"))
  assert [r["step"] for r in rows if "eval_loss" in r] == [2] and np.isfinite(final["eval_loss"])


def test_states_saved_before_holdout_existed_still_restore(tmp_path):
  """A corpus split by documents has holdout None, so checkpoints from before the key still resume."""
  write_cache(str(tmp_path), [np.arange(10 * d + 1, 10 * d + 9) for d in range(40)], 2**16, "docs")
  p = TextPipeline(**args(str(tmp_path), eval_fraction=0.2))
  next(p)
  state = p.get_state()
  assert state["stream"].pop("holdout") is None
  want = next(p)
  again = TextPipeline(**args(str(tmp_path), eval_fraction=0.2))
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["inputs"], want["inputs"])
