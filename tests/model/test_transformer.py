"""Model properties: causality, document masking, remat and scan invariance, KV-cache decoding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.model import ModelConfig, Transformer, decode_logits, init_cache, param_count
from tests.fixtures import tiny_config


_apply = jax.jit(Transformer.apply, static_argnums=0, static_argnames=("mutable",))


class Jitted(Transformer):
  """The model with `apply` jitted once per model: eager dispatch makes these tests 10x slower."""

  def apply(self, variables, *args, mutable=False, **kwargs):
    mutable = tuple(mutable) if isinstance(mutable, list) else mutable
    return _apply(self, variables, *args, mutable=mutable, **kwargs)


def make(**model):
  c = tiny_config(model=model)
  mc = ModelConfig.from_config(c.model)
  m = Jitted(mc)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, mc.vocab_size)
  params = nn.unbox(jax.jit(m.init)(jax.random.key(0), tokens)["params"])
  return m, params, tokens


def test_causal():
  m, params, tokens = make()
  changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 64)
  a, b = m.apply({"params": params}, tokens), m.apply({"params": params}, changed)
  np.testing.assert_array_equal(a[:, :9], b[:, :9])
  assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def test_no_attention_across_documents():
  m, params, tokens = make()
  seg = jnp.array([[1] * 6 + [2] * 10] * 2)
  pos = jnp.array([list(range(6)) + list(range(10))] * 2)
  packed = m.apply({"params": params}, tokens, pos, seg)
  alone = m.apply({"params": params}, tokens[:, 6:])  # the second document by itself
  np.testing.assert_allclose(packed[:, 6:], alone, atol=1e-5)
  other = tokens.at[:, :6].set((tokens[:, :6] + 3) % 64)  # changing document 1 leaves document 2
  np.testing.assert_array_equal(m.apply({"params": params}, other, pos, seg)[:, 6:], packed[:, 6:])


def test_branches_see_the_shared_prefix_and_themselves_only():
  """A prefix of 5 tokens, then branches of 4, 3 and 4 (branch ids 0, 1, 2, 3; each branch's
  positions continue the prefix's): each branch's logits are those of prefix + branch alone, and a
  change in one branch leaves the others."""
  m, params, tokens = make()
  tokens = tokens[:1]
  spans, branch = [(0, 5), (5, 9), (9, 12), (12, 16)], np.zeros(16, np.int32)
  pos = np.zeros(16, np.int32)
  for b, (lo, hi) in enumerate(spans):
    branch[lo:hi], pos[lo:hi] = b, (5 if b else 0) + np.arange(hi - lo)
  ids = dict(segment_ids_BL=jnp.ones((1, 16), jnp.int32), branch_ids_BL=jnp.asarray(branch)[None])
  shared = m.apply({"params": params}, tokens, jnp.asarray(pos)[None], **ids)
  for lo, hi in spans[1:]:
    alone = m.apply({"params": params}, jnp.concatenate([tokens[:, :5], tokens[:, lo:hi]], 1))
    np.testing.assert_allclose(shared[:, lo:hi], alone[:, 5:], atol=1e-5)
  other = tokens.at[:, 5:9].set((tokens[:, 5:9] + 3) % 64)
  changed = m.apply({"params": params}, other, jnp.asarray(pos)[None], **ids)
  np.testing.assert_array_equal(changed[:, 9:], shared[:, 9:])
  assert np.abs(changed[:, 5:9] - shared[:, 5:9]).max() > 1e-3


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_equals_no_remat(remat):
  m, params, tokens = make()
  m2, params2, _ = make(remat=remat)
  assert jax.tree.structure(params) == jax.tree.structure(params2)

  def loss(model, p):
    return jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, tokens))[..., 0])

  l1, g1 = jax.value_and_grad(lambda p: loss(m, p))(params)
  l2, g2 = jax.value_and_grad(lambda p: loss(m2, p))(params)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)


def test_scanned_and_unrolled_share_params_and_outputs():
  m, params, tokens = make(scan_layers=True)
  m2, params2, _ = make(scan_layers=False)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, params2)
  np.testing.assert_allclose(m.apply({"params": params}, tokens), m2.apply({"params": params}, tokens),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [pytest.param(4, marks=pytest.mark.slow), 2,  # MHA (slow: ~15 s each), GQA,
                                      pytest.param(1, marks=pytest.mark.slow)])  # MQA
def test_kv_cache_decoding_equals_full_forward(kv_heads):
  m, params, tokens = make(n_kv_heads=kv_heads, tie_embeddings=False)
  full = m.apply({"params": params}, tokens)
  cache = init_cache(m, tokens.shape[0])
  logits, cache = decode_logits(m, params, cache, tokens[:, :5], 0)  # prefill
  pieces = [logits]
  for i in range(5, tokens.shape[1]):
    logits, cache = decode_logits(m, params, cache, tokens[:, i:i + 1], i)
    pieces.append(logits)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=2e-5)


def test_param_count_formula_matches_tree():
  for tie in (True, False):
    m, params, _ = make(tie_embeddings=tie)
    assert sum(x.size for x in jax.tree.leaves(params)) == param_count(m.cfg)


def test_rope_theta_changes_logits():
  m, params, tokens = make()
  m2, _, _ = make(rope_theta=500000.0)
  assert np.abs(m.apply({"params": params}, tokens) - m2.apply({"params": params}, tokens)).max() > 1e-4


def test_logits_are_float32_under_bf16_compute():
  m, params, tokens = make(compute_dtype="bfloat16")
  assert m.apply({"params": params}, tokens).dtype == jnp.float32
