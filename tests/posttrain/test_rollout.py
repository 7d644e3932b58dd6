"""Rollouts (jaxtrain/posttrain/rollout.py) against decoding by full forward passes over each prompt alone:
greedy tokens, stop tokens, top-k/top-p limits, sampling log-probs, the naive sampler, and a 2 data x 4 fsdp
mesh against one device."""

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import parallel
from jaxtrain.model import ModelConfig, Transformer
from jaxtrain.posttrain import rl, rollout as rollout_lib
from tests.fixtures import tiny_config

P, N = 6, 8
LENS = np.array([6, 3, 1, 5, 2, 6, 4, 3])  # mixed prompt lengths; 8 rows divide over 2 x 4 devices


@pytest.fixture(scope="module")
def setup():
  """A tiny untied model, its params, left-padded prompts (pad id 0 where masked) and their rows unpadded."""
  mc = ModelConfig.from_config(tiny_config(model={"max_seq_len": 16, "tie_embeddings": False}).model)
  model = Transformer(mc)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
  rows = [np.random.default_rng(i).integers(1, mc.vocab_size, n) for i, n in enumerate(LENS)]
  prompts = np.zeros((len(LENS), P), np.int32)
  for b, row in enumerate(rows):
    prompts[b, P - len(row):] = row
  return model, params, prompts, rows


@functools.cache
def jitted(fn):
  return jax.jit(fn, static_argnames=rollout_lib.STATIC_ARGNAMES)


def run(setup, fn=rollout_lib.rollout, seed=1, **kw):
  model, params, prompts, _ = setup
  return jax.device_get(jitted(fn)(model, params, prompts, jnp.asarray(LENS), jax.random.key(seed), N, **kw))


def full_forward_logits(setup, tokens_BN):
  """Logits [B, N, V] predicting tokens_BN after each prompt, by one full forward of each row's prompt and
  tokens alone (right-aligned after nothing: positions from 0, no padding, no cache)."""
  model, params, _, rows = setup
  seq = np.zeros((len(rows), model.cfg.max_seq_len), np.int32)  # causal: trailing zeros change nothing before
  for b, row in enumerate(rows):
    seq[b, :len(row)], seq[b, len(row):len(row) + N] = row, tokens_BN[b]
  logits = np.asarray(jax.jit(model.apply)({"params": params}, seq))
  return np.stack([logits[b, len(row) - 1:len(row) - 1 + N] for b, row in enumerate(rows)])


def greedy_by_full_forward(setup):
  model, params, _, rows = setup
  forward = jax.jit(model.apply)
  seq = np.zeros((len(rows), model.cfg.max_seq_len), np.int32)
  for b, row in enumerate(rows):
    seq[b, :len(row)] = row
  for i in range(N):
    logits = np.asarray(forward({"params": params}, seq))
    for b, row in enumerate(rows):
      seq[b, len(row) + i] = np.argmax(logits[b, len(row) + i - 1])
  return np.stack([seq[b, len(row):len(row) + N] for b, row in enumerate(rows)])


@pytest.fixture(scope="module")
def greedy(setup):
  return greedy_by_full_forward(setup)


def test_greedy_rollout_equals_full_forward_greedy(setup, greedy):
  out = run(setup, temperature=0.0)
  np.testing.assert_array_equal(out.tokens_BN, greedy)
  assert np.all(out.mask_BN == 1) and np.all(out.lengths_B == N)
  np.testing.assert_array_equal(run(setup, rollout_lib.naive_rollout, temperature=0.0).tokens_BN, greedy)
  # pad slots are masked out of attention: whatever tokens they hold, nothing changes
  model, params, prompts, _ = setup
  junk = np.where(prompts == 0, np.random.default_rng(9).integers(1, model.cfg.vocab_size, prompts.shape), prompts)
  again = jitted(rollout_lib.rollout)(model, params, junk, jnp.asarray(LENS), jax.random.key(1), N, temperature=0.0)
  np.testing.assert_array_equal(again.tokens_BN, greedy)


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_greedy(setup, greedy, kw):
  np.testing.assert_array_equal(run(setup, temperature=1.0, **kw).tokens_BN, greedy)


def test_stop_tokens_end_rows(setup, greedy):
  stops = (int(greedy[0, 3]), int(greedy[1, 0]))
  out = run(setup, temperature=0.0, stop_tokens=stops, pad_id=0)
  for b in range(len(LENS)):
    hits = [i for i in range(N) if greedy[b, i] in stops]
    length = hits[0] + 1 if hits else N
    assert out.lengths_B[b] == length
    np.testing.assert_array_equal(out.mask_BN[b], np.arange(N) < length)
    np.testing.assert_array_equal(out.tokens_BN[b, :length], greedy[b, :length])
    assert np.all(out.tokens_BN[b, length:] == 0) and np.all(out.logp_BN[b, length:] == 0)
  assert out.lengths_B[0] <= 4 and out.lengths_B[1] == 1 and out.lengths_B.min() < N


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), pytest.param(0.5, 5, marks=pytest.mark.slow)])
def test_sampling_logprobs_equal_full_forward(setup, temperature, top_k):
  out = run(setup, seed=3, temperature=temperature, top_k=top_k)
  logits = full_forward_logits(setup, out.tokens_BN) / temperature
  # the distribution the tokens came from: the softmax renormalized over the row's top k
  kept = logits if not top_k else np.where(logits < np.sort(logits, -1)[..., -top_k:-top_k + 1], -np.inf, logits)
  logsm = logits - np.log(np.exp(kept - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
      -1, keepdims=True)
  want = np.take_along_axis(logsm, out.tokens_BN[..., None], -1)[..., 0]
  np.testing.assert_allclose(out.logp_BN, want, rtol=1e-4, atol=1e-5)
  if top_k:  # every draw among the row's top k
    rank = (logits > np.take_along_axis(logits, out.tokens_BN[..., None], -1)).sum(-1)
    assert rank.max() < top_k
  else:  # samples, not the greedy path
    assert np.any(out.tokens_BN != np.argmax(logits, -1))
  # the training-side inputs give the same log-probs from one forward of the padded batch
  model, params, prompts, _ = setup
  tokens, positions, segments = rollout_lib.sequence_inputs(prompts, jnp.asarray(LENS), out.tokens_BN)
  full = jax.jit(model.apply)({"params": params}, tokens, positions, segments) / temperature
  got = rl.sampled_logprobs(rollout_lib.response_logits(full, P, N), out.tokens_BN, top_k)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_naive_sampler_draws_the_same_samples(setup):
  kw = dict(seed=5, temperature=0.8, top_p=0.9, stop_tokens=(7,))
  a, b = run(setup, **kw), run(setup, rollout_lib.naive_rollout, **kw)
  np.testing.assert_array_equal(a.tokens_BN, b.tokens_BN)
  np.testing.assert_array_equal(a.lengths_B, b.lengths_B)
  np.testing.assert_allclose(a.logp_BN, b.logp_BN, rtol=1e-4, atol=1e-5)


def sharded_run(setup, seed, **kw):
  """The rollout on a 2 data x 4 fsdp mesh: params sharded as the policy (fsdp rules), rows over the data axes."""
  model, params, prompts, _ = setup
  mesh = parallel.make_mesh(tiny_config(mesh=dict(data=2, fsdp=4)).mesh)
  boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  sharded = jax.device_put(params, parallel.logical_shardings(nn.get_partition_spec(boxed), mesh, "fsdp"))
  assert sharded["embed"].sharding.spec != jax.sharding.PartitionSpec()  # the params really are sharded
  data = parallel.batch_sharding(mesh)
  prompts_s, lens_s = jax.device_put((prompts, jnp.asarray(LENS)), data)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES["fsdp"]):
    out = jitted(rollout_lib.rollout)(model, sharded, prompts_s, lens_s, jax.random.key(seed), N, **kw)
  assert out.tokens_BN.sharding.is_equivalent_to(data, 2)  # rows stay over the data axes
  return jax.device_get(out)


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_sharded_sampled_rollout_equals_unsharded(setup):
  kw = dict(temperature=0.9, top_k=20, stop_tokens=(5,))
  got, want = sharded_run(setup, 2, **kw), run(setup, seed=2, **kw)
  np.testing.assert_array_equal(got.tokens_BN, want.tokens_BN)
  np.testing.assert_array_equal(got.lengths_B, want.lengths_B)
  np.testing.assert_allclose(got.logp_BN, want.logp_BN, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sharded_greedy_rollout_equals_full_forward_greedy(setup, greedy):
  np.testing.assert_array_equal(sharded_run(setup, 1, temperature=0.0).tokens_BN, greedy)


def test_groups_and_left_pad():
  prompts = jnp.asarray([[3, 4, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]])
  lens = jnp.asarray([2, 4, 1])
  np.testing.assert_array_equal(rollout_lib.left_pad(prompts, lens),
                                [[0, 0, 3, 4], [5, 6, 7, 8], [0, 0, 0, 9]])
  rep, rep_lens = rollout_lib.repeat_groups(prompts, lens, 3)
  np.testing.assert_array_equal(rep, np.repeat(np.asarray(prompts), 3, axis=0))
  np.testing.assert_array_equal(rep_lens, [2, 2, 2, 4, 4, 4, 1, 1, 1])


def test_group_rows_draw_different_samples(setup):
  model, params, prompts, _ = setup
  rep, rep_lens = rollout_lib.repeat_groups(prompts[:2], jnp.asarray(LENS[:2]), 4)
  out = jitted(rollout_lib.rollout)(model, params, rep, rep_lens, jax.random.key(0), N, temperature=1.0, top_k=0)
  tokens = np.asarray(out.tokens_BN).reshape(2, 4, N)
  assert all(len({tuple(r) for r in tokens[g]}) > 1 for g in range(2))


def test_too_long_is_refused(setup):
  model, params, prompts, _ = setup
  with pytest.raises(ValueError, match="max_seq_len=16"):
    rollout_lib.rollout(model, params, prompts, jnp.asarray(LENS), jax.random.key(0), 11)


@pytest.mark.optimized
@pytest.mark.slow
def test_rollout_is_5x_the_naive_sampler():
  """Issue 13: tokens/s of the KV-cache rollout >= 5x the naive sampler at 128 new tokens (benchmarks/rollout.py,
  configs/tiny.py's model, batch 8, prompts of 16)."""
  import sys
  from tests.fixtures import ROOT
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import rollout as bench
  from jaxtrain import config_files
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  t = bench.measure(cfg.model, batch_size=8, prompt_len=16, new_tokens=128, repeats=3)
  assert t["naive"] / t["rollout"] >= 5, t
