"""Attention by segment ids and token indices, in plain jnp: the definition every implementation is
tested against. It materializes the [B, H, L, S] scores, so it is for tests and short sequences.

Shapes (jaxtrain/model/axes.py): q [B, L, H, K], k and v [B, S, G, K] with H a multiple of G
(grouped-query attention; G = 1 is MQA); segment ids [B, L] / [B, S], 0 = padding; indices [B, L] /
[B, S], each token's place in its un-permuted row, which orders it causally (context parallelism
permutes the rows). `causal=False` (a bidirectional encoder): documents only, every key of the
query's document.
"""

import jax
import jax.numpy as jnp


def mask(q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, causal=True):
  """[B, L, S] True where a query may attend a key: the same non-padding document,
  key not in the future (any key of it when not `causal`)."""
  same_doc = (q_segment_BL[:, :, None] == k_segment_BS[:, None, :]) & (k_segment_BS[:, None, :] > 0)
  if not causal:
    return same_doc
  return same_doc & (k_index_BS[:, None, :] <= q_index_BL[:, :, None])


def attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
              causal=True):
  """Softmax(q k^T / sqrt(K)) v in float32, out in q's dtype;
  a query that may attend no key gets zeros."""
  b, l, h, kd = q_BLHK.shape
  g = k_BSGK.shape[2]
  q_BLGRK = q_BLHK.reshape(b, l, g, h // g, kd).astype(jnp.float32)
  scores_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK.astype(jnp.float32)) / jnp.sqrt(kd)
  mask_BLS = mask(q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, causal)
  scores_BGRLS = jnp.where(mask_BLS[:, None, None], scores_BGRLS, -jnp.inf)
  probs_BGRLS = jax.nn.softmax(scores_BGRLS, axis=-1, where=mask_BLS[:, None, None])
  probs_BGRLS = jnp.where(mask_BLS[:, None, None], probs_BGRLS, 0.0)
  out_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", probs_BGRLS, v_BSGK.astype(jnp.float32))
  return out_BLGRK.reshape(b, l, h, kd).astype(q_BLHK.dtype)
