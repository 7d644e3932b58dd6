"""The model through `attend`: blockwise equals xla in a Transformer over packed rows, decodes with the KV
cache, and rows permuted with their indices (context parallelism's view) give the permuted logits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.model import ModelConfig, Transformer, decode_logits, init_cache
from tests.fixtures import tiny_config


def model(**overrides):
  return Transformer(ModelConfig.from_config(tiny_config(model=overrides).model))


def packed_batch():
  """Two rows of 20 tokens: documents of 7 and 9 tokens then padding, and one of 20."""
  tokens_BL = jax.random.randint(jax.random.key(1), (2, 20), 0, 64)
  segment_BL = jnp.array([[1] * 7 + [2] * 9 + [0] * 4, [1] * 20])
  positions_BL = jnp.array([list(range(7)) + list(range(9)) + [0] * 4, list(range(20))])
  return tokens_BL, positions_BL, segment_BL


@pytest.mark.slow  # ~10 s; blockwise == reference stays in the default set (tests/kernels/test_attention.py)
def test_blockwise_equals_xla_on_valid_tokens():
  """Logits and the gradient of a loss over valid tokens; block 8 does not divide 20."""
  xla, blockwise = model(attention="xla"), model(attention="blockwise", attention_block=8)
  tokens_BL, positions_BL, segment_BL = packed_batch()
  params = nn.unbox(jax.jit(xla.init)(jax.random.key(0), tokens_BL)["params"])

  def loss(m, p):
    logits_BLV = m.apply({"params": p}, tokens_BL, positions_BL, segment_BL)
    logp_BL = jnp.take_along_axis(jax.nn.log_softmax(logits_BLV), tokens_BL[..., None], -1)[..., 0]
    return -jnp.sum(jnp.where(segment_BL > 0, logp_BL, 0.0)), logits_BLV

  (loss_x, logits_x), grads_x = jax.jit(jax.value_and_grad(lambda p: loss(xla, p), has_aux=True))(params)
  (loss_b, logits_b), grads_b = jax.jit(jax.value_and_grad(lambda p: loss(blockwise, p), has_aux=True))(params)
  valid = np.asarray(segment_BL > 0)
  np.testing.assert_allclose(np.asarray(logits_b)[valid], np.asarray(logits_x)[valid], atol=2e-5, rtol=0)
  np.testing.assert_allclose(loss_b, loss_x, rtol=1e-6)
  for gb, gx in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_x)):
    np.testing.assert_allclose(gb, gx, atol=1e-6, rtol=1e-4)


def test_blockwise_decode_equals_full_forward():
  """Prefill 5 tokens, then 3 one at a time through the cache: the logits of the full forward."""
  m = model(attention="blockwise", attention_block=8)  # max_seq_len 32: four cache blocks
  tokens_BL = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)
  params = nn.unbox(jax.jit(m.init)(jax.random.key(0), tokens_BL)["params"])
  full_BLV = jax.jit(m.apply)({"params": params}, tokens_BL)
  step = jax.jit(decode_logits, static_argnums=0)
  cache = init_cache(m, 2)
  logits, cache = step(m, params, cache, tokens_BL[:, :5], 0)
  got = [logits]
  for i in range(5, 8):
    logits, cache = step(m, params, cache, tokens_BL[:, i:i + 1], i)
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), full_BLV, atol=2e-5, rtol=0)


@pytest.mark.slow  # four compiles (~10 s); tests/kernels covers permuted indices per implementation
def test_rows_permuted_with_their_indices_give_permuted_logits():
  """Causality follows `indices_BL`, not the place in the row, for xla and blockwise alike."""
  tokens_BL, positions_BL, segment_BL = packed_batch()
  order = np.random.default_rng(0).permutation(20)
  indices_BL = jnp.broadcast_to(jnp.arange(20), (2, 20))
  for name in ("xla", "blockwise"):
    m = model(attention=name, attention_block=8)
    params = nn.unbox(jax.jit(m.init)(jax.random.key(0), tokens_BL)["params"])
    apply = jax.jit(m.apply)
    plain_BLV = apply({"params": params}, tokens_BL, positions_BL, segment_BL)
    permuted_BLV = apply({"params": params}, tokens_BL[:, order], positions_BL[:, order], segment_BL[:, order],
                         indices_BL[:, order])
    valid = np.asarray(segment_BL[:, order] > 0)
    np.testing.assert_allclose(np.asarray(permuted_BLV)[valid], np.asarray(plain_BLV)[:, order][valid],
                               atol=2e-5, rtol=0)
