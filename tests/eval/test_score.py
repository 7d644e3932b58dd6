"""Packed scoring (eval/score.py) against each request scored alone by a plain forward pass, left
truncation included; rolling windows predict every token once; the same scores on an 8-device
mesh."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import config as config_lib, parallel
from jaxtrain.eval import score
from jaxtrain.model import ModelConfig, Transformer
from tests.fixtures import tiny_config

SEQ_LEN = 16


@pytest.fixture(scope="module")
def model():
  """The tiny float32 model (vocab 64, max_seq_len 32) and random params."""
  cfg = ModelConfig.from_config(tiny_config().model)
  module = Transformer(cfg)
  params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  return cfg, module, jax.tree.map(np.asarray, nn.unbox(params))


def alone(module, params, reqs, seq_len=SEQ_LEN):
  """(sum log-prob, is_greedy) of each request: its last seq_len + 1 tokens at the start of a row of
  its own (right padding cannot reach back through causal attention), no segment ids, one plain
  forward pass."""
  fulls = [np.concatenate([r.context, r.continuation])[-(seq_len + 1):] for r in reqs]
  tokens_BL = np.zeros((len(reqs), seq_len), np.int32)
  for b, full in enumerate(fulls):
    tokens_BL[b, :len(full) - 1] = full[:-1]
  logits_BLV = np.asarray(jax.jit(module.apply)({"params": params}, tokens_BL), np.float64)
  logp_BLV = logits_BLV - np.log(np.exp(logits_BLV).sum(-1, keepdims=True))
  out = []
  for b, (r, full) in enumerate(zip(reqs, fulls)):
    slots = np.arange(len(full) - 1)[-len(r.continuation):]
    targets = full[1:][-len(r.continuation):]
    greedy = bool(np.all(logits_BLV[b, slots].argmax(-1) == targets))
    out.append((logp_BLV[b, slots, targets].sum(), greedy))
  return out


def requests(module, params, n=13, seed=0):
  """Random requests of mixed lengths, three longer than SEQ_LEN (cut from the left), and one whose
  continuation is the model's greedy token (is_greedy must be True)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    n_ctx = int(rng.integers(1, 30 if i % 4 == 0 else 9))
    out.append(score.Request(rng.integers(0, 64, n_ctx).astype(np.int32),
                             rng.integers(0, 64, int(rng.integers(1, 5))).astype(np.int32)))
  ctx = rng.integers(0, 64, 6).astype(np.int32)
  greedy = int(np.asarray(jax.jit(module.apply)({"params": params}, ctx[None]))[0, -1].argmax())
  return out + [score.Request(ctx, np.array([greedy], np.int32))]


def test_short_requests_pack_into_shorter_rows_with_the_same_scores(model):
  """A call's row length: the power of two with the fewest FLOPs for its requests; a batch holds
  at most rows * seq_len tokens, its rows shared evenly among the call's batches; scores equal to
  each request alone."""
  assert score.packed_rows([10, 9, 6, 5], 16) == 2  # first-fit decreasing: 10+6, 9+5
  assert score.packed_rows([10, 9, 6, 5], 32) == 1
  assert score.rows_at(16, 4, 32) == 8 and score.rows_at(32, 4, 32) == 4
  assert score.rows_at(16, 3, 256) == 48  # still a multiple of 3, for the data axes
  flat = lambda length: 1.0  # attention costs nothing: the fewest slots win
  growing = lambda length: 1.0 + length / 64  # attention dominates: short rows win
  # rows needed at each row length, for the same units at every length
  same = lambda lengths: lambda length: score.packed_rows(sorted(lengths, reverse=True), length)
  assert score.row_length(same([40] * 600), 40, 8, 256, flat) == 128  # 3 a row (94%) beats 1 (63%)
  assert score.row_length(same([40] * 600), 40, 8, 256, growing) == 64
  assert score.row_length(same([200, 3]), 200, 8, 256, growing) == 256  # never below the longest
  assert score.row_length(same([5] * 200), 5, 8, 256, growing) == 16  # rows of MIN_ROW_LEN
  assert score.row_length(same([5] * 200), 5, 8, 256, flat) == 128  # 8 rows, 1024 slots (16: 1072)
  assert score.batch_rows(66, 16, 1) == 14  # 5 batches of 14 rows, not 4 of 16 and one of 2
  assert score.batch_rows(66, 16, 4) == 16 and score.batch_rows(9, 16, 2) == 10
  cfg, module, params = model
  rng = np.random.default_rng(3)
  reqs = [score.Request(rng.integers(0, 64, int(rng.integers(1, 9))).astype(np.int32),
                        rng.integers(0, 64, int(rng.integers(1, 5))).astype(np.int32))
          for _ in range(11)]
  scorer = score.Scorer(cfg, params, rows=4, seq_len=32)
  lengths = [len(r.context) + len(r.continuation) - 1 for r in reqs]
  assert score.row_length(same(lengths), max(lengths), 4, 32, scorer._flops_per_token) == 16
  got = scorer.loglikelihood(reqs)
  want = alone(module, params, reqs, seq_len=32)
  assert np.allclose([g.logprob for g in got], [w[0] for w in want], atol=1e-5, rtol=0)
  assert [g.is_greedy for g in got] == [w[1] for w in want]


def test_packed_scores_equal_each_request_alone(model):
  cfg, module, params = model
  reqs = requests(module, params)
  batches = list(score.pack(units(reqs), 4, SEQ_LEN))
  assert len(batches) < -(-len(reqs) // 4)  # rows hold several requests
  assert max(int(b["segment_ids"].max()) for b, _ in batches) >= 2
  got = score.Scorer(cfg, params, rows=4, seq_len=SEQ_LEN).loglikelihood(reqs)
  want = alone(module, params, reqs)
  assert np.allclose([g.logprob for g in got], [w[0] for w in want], atol=1e-5, rtol=0)
  assert [g.is_greedy for g in got] == [w[1] for w in want]
  assert got[-1].is_greedy
  cuts = [max(0, len(r.context) + len(r.continuation) - 1 - SEQ_LEN) for r in reqs]
  assert [g.truncated for g in got] == cuts and sum(c > 0 for c in cuts) >= 2


def units(reqs, length=SEQ_LEN, share=True):
  return score.units(reqs, [score.fit(r, SEQ_LEN)[0] for r in reqs], length, share)


def test_pack_masks_padding_and_restarts_positions(model):
  """A request alone: its context + continuation from position 0, in a document of its own."""
  reqs = requests(*model[1:])
  for batch, spans in score.pack(units(reqs), 4, SEQ_LEN):
    for s in spans:
      full = score.fit(reqs[s.request], SEQ_LEN)[0]
      start = s.end - len(full) + 1  # the document's first slot
      assert np.all(batch["positions"][s.row, start:s.end] == np.arange(len(full) - 1))
      assert np.all(batch["inputs"][s.row, start:s.end] == full[:-1])
      assert np.all(batch["targets"][s.row, s.start:s.end] == reqs[s.request].continuation)
      seg = batch["segment_ids"][s.row, start:s.end]
      assert seg.min() == seg.max() > 0
      assert np.all(batch["branch_ids"][s.row, start:s.end] == (np.arange(start, s.end) >= s.start))
    used = sum(len(score.fit(reqs[s.request], SEQ_LEN)[0]) - 1 for s in spans)
    assert np.sum(batch["segment_ids"] > 0) == used


def choice_requests(n_docs=6, seed=2):
  """Multiple-choice requests: 1-4 continuations of each of n_docs contexts, one context longer than
  SEQ_LEN (its requests cut from the left, each by its own continuation's length)."""
  rng = np.random.default_rng(seed)
  out = []
  for d in range(n_docs):
    ctx = rng.integers(0, 64, 20 if d == 0 else int(rng.integers(1, 10))).astype(np.int32)
    out += [score.Request(ctx, rng.integers(0, 64, int(rng.integers(1, 5))).astype(np.int32))
            for _ in range(int(rng.integers(1, 5)) if d else 3)]
  return out


def test_requests_that_share_a_context_score_it_once(model):
  """The choices of one context are one document (the context but its last token, then a branch per
  choice that sees the context and itself) with the scores of each request alone; a context whose
  choices do not fit one row is split over several; fewer slots than each alone."""
  cfg, module, params = model
  reqs = choice_requests()
  fitted = [score.fit(r, SEQ_LEN)[0] for r in reqs]
  shared, alone_units = units(reqs), units(reqs, share=False)
  assert len(alone_units) == len(reqs) and len(shared) < len(reqs)
  assert sum(map(score.unit_length, shared)) < sum(map(score.unit_length, alone_units))
  assert all(score.unit_length(u) <= SEQ_LEN for u in shared)
  for u in shared:
    for b in u.branches:
      assert np.array_equal(np.concatenate([u.trunk, b.inputs, b.targets[-1:]]), fitted[b.request])
  rest = reqs[3:]  # at most 10 inputs each: at length 10 a context of 7 and choices of 2 and 3 part
  small = units(rest, length=10)
  assert len(small) > len(units(rest)) and all(score.unit_length(u) <= 10 for u in small)
  assert sorted(b.request for u in small for b in u.branches) == list(range(len(rest)))
  for batch, spans in score.pack(shared, 2, SEQ_LEN):
    for s in spans:  # a branch continues the trunk's positions
      n = len(fitted[s.request]) - len(reqs[s.request].continuation)
      assert np.array_equal(batch["positions"][s.row, s.start:s.end],
                            n - 1 + np.arange(s.end - s.start))
  want = alone(module, params, reqs)
  for scorer in (score.Scorer(cfg, params, rows=2, seq_len=SEQ_LEN),
                 score.Scorer(cfg, params, rows=2, seq_len=SEQ_LEN, share_contexts=False)):
    got = scorer.loglikelihood(reqs)
    assert np.allclose([g.logprob for g in got], [w[0] for w in want], atol=1e-5, rtol=0)
    assert [g.is_greedy for g in got] == [w[1] for w in want]
    assert [g.truncated for g in got][:3] == [max(0, 20 + len(r.continuation) - 1 - SEQ_LEN)
                                              for r in reqs[:3]]


def test_rolling_windows_predict_every_token_once():
  ids = np.arange(100, 137, dtype=np.int32)
  windows = score.rolling_requests(ids, 1, 16)
  assert [len(w.continuation) for w in windows] == [16, 16, 5]
  assert np.array_equal(np.concatenate([w.continuation for w in windows]), ids)
  assert [int(w.context[-1]) for w in windows] == [1, ids[15], ids[31]]
  assert all(len(w.context) + len(w.continuation) - 1 <= 16 for w in windows)


@pytest.mark.parametrize("context, continuation, message", [
    (2, 17, "a continuation of 17 tokens is longer than the model's length 16"),
    (0, 3, "at least one token each, got 0 and 3"),
    (2, 0, "at least one token each, got 2 and 0"),
])
def test_requests_that_cannot_be_scored_are_one_line(model, context, continuation, message):
  cfg, _, params = model
  with pytest.raises(config_lib.ConfigError, match=message) as e:
    score.Scorer(cfg, params, seq_len=SEQ_LEN).loglikelihood(
        [score.Request(np.ones(context, np.int32), np.ones(continuation, np.int32))])
  assert "\n" not in str(e.value)


def test_a_token_outside_the_vocabulary_is_one_line(model):
  cfg, _, params = model
  with pytest.raises(config_lib.ConfigError,
                     match=r"token id 64 is outside the model's vocabulary"):
    request = score.Request(np.ones(2, np.int32), np.array([64], np.int32))
    score.Scorer(cfg, params).loglikelihood([request])


def test_sharded_over_a_mesh_equals_one_device(model):
  cfg, module, params = model
  reqs = requests(module, params, n=9, seed=1) + choice_requests(4)
  mesh = parallel.make_mesh(tiny_config(mesh={"data": 2, "fsdp": -1}).mesh)
  sharded = score.Scorer(cfg, params, rows=3, seq_len=SEQ_LEN, mesh=mesh)
  assert sharded.rows == 8  # rounded up to a multiple of the data shards (data 2 x fsdp 4)
  got = sharded.loglikelihood(reqs)
  want = score.Scorer(cfg, params, rows=4, seq_len=SEQ_LEN).loglikelihood(reqs)
  assert np.allclose([g.logprob for g in got], [w.logprob for w in want], atol=1e-5, rtol=0)
  assert [g.is_greedy for g in got] == [w.is_greedy for w in want]
