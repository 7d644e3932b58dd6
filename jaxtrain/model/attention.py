"""Grouped-query attention (Ainslie et al., 2023) with rotary positions, document masking and a
KV cache for autoregressive decoding. MHA is n_kv_heads == n_heads, MQA is n_kv_heads == 1."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.collectives import constrain
from jaxtrain.kernels.attention import reference
from jaxtrain.model import axes, context
from jaxtrain.model.layers import param, rope

NEG_INF = -1e30


def attention_mask(q_segment_BL, k_segment_BS, q_index_BL, k_index_BS):
  """True where query may attend key: same (non-padding) document and key not in the future.

  Built once per forward pass and shared by all layers."""
  same_doc = (q_segment_BL[:, :, None] == k_segment_BS[:, None, :]) & (k_segment_BS[:, None, :] > 0)
  causal = k_index_BS[:, None, :] <= q_index_BL[:, :, None]
  return same_doc & causal


def dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask_BLS):
  """Softmax attention in float32; each kv head serves n_heads / n_kv_heads query heads."""
  r = q_BLHK.shape[2] // k_BSGK.shape[2]
  k_BSHK, v_BSHK = jnp.repeat(k_BSGK, r, axis=2), jnp.repeat(v_BSGK, r, axis=2)
  scale = 1.0 / jnp.sqrt(q_BLHK.shape[-1]).astype(jnp.float32)
  scores_BHLS = jnp.einsum("BLHK,BSHK->BHLS", q_BLHK, k_BSHK, preferred_element_type=jnp.float32) * scale
  scores_BHLS = jnp.where(mask_BLS[:, None], scores_BHLS, NEG_INF)
  probs_BHLS = jax.nn.softmax(scores_BHLS, axis=-1).astype(v_BSHK.dtype)
  return jnp.einsum("BHLS,BSHK->BLHK", probs_BHLS, v_BSHK)


class Attention(nn.Module):
  cfg: "ModelConfig"  # noqa: F821 (jaxtrain.model.transformer.ModelConfig)
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD, positions_BL, mask_BLS):
    c = self.cfg
    pd, cd = c.param_dtype, c.compute_dtype
    std, out_std = c.init_std, c.init_std / (2 * c.n_layers) ** 0.5
    w_q = param(self, "q", (c.d_model, c.n_heads, c.head_dim), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pd, std)
    w_k = param(self, "k", (c.d_model, c.n_kv_heads, c.head_dim), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd, std)
    w_v = param(self, "v", (c.d_model, c.n_kv_heads, c.head_dim), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd, std)
    w_o = param(self, "o", (c.n_heads, c.head_dim, c.d_model), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pd, out_std)

    x_BLD = x_BLD.astype(cd)
    q_BLHK = jnp.einsum("BLD,DHK->BLHK", x_BLD, w_q.astype(cd))
    k_BLGK = jnp.einsum("BLD,DGK->BLGK", x_BLD, w_k.astype(cd))
    v_BLGK = jnp.einsum("BLD,DGK->BLGK", x_BLD, w_v.astype(cd))
    q_BLHK = constrain(rope(q_BLHK, positions_BL, c.rope_theta), (axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM))
    k_BLGK = constrain(rope(k_BLGK, positions_BL, c.rope_theta), (axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM))
    v_BLGK = constrain(v_BLGK, (axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM))

    if self.decode:
      k_BSGK, v_BSGK, mask_BLS = self._update_cache(k_BLGK, v_BLGK)
    else:
      k_BSGK, v_BSGK = k_BLGK, v_BLGK

    if isinstance(mask_BLS, tuple):  # [context parallelism] (segment_ids_BL, indices_BL) from the Transformer
      segment_BL, index_BL = mask_BLS  # until attention takes them itself (the segment-id refactor)
      out_BLHK = context.context_attention(q_BLHK, k_BSGK, v_BSGK, segment_BL, segment_BL, index_BL, index_BL,
                                           reference.attention)
    else:
      out_BLHK = dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask_BLS)
    out_BLHK = constrain(out_BLHK, (axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM))
    return jnp.einsum("BLHK,HKD->BLD", out_BLHK, w_o.astype(cd))

  def _update_cache(self, k_BLGK, v_BLGK):
    """Writes the new keys/values at the cache index; masks unwritten and future slots.

    Decoding holds one document per row, whose positions count from the cache index."""
    b, l, g, kd = k_BLGK.shape
    s = self.cfg.max_seq_len
    cached_k = self.variable("cache", "k", jnp.zeros, (b, s, g, kd), k_BLGK.dtype)
    cached_v = self.variable("cache", "v", jnp.zeros, (b, s, g, kd), v_BLGK.dtype)
    index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    i = index.value
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k_BLGK, (0, i, 0, 0))
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v_BLGK, (0, i, 0, 0))
    index.value = i + l
    q_index_BL = jnp.broadcast_to(i + jnp.arange(l), (b, l))
    k_index_BS = jnp.broadcast_to(jnp.arange(s), (b, s))
    ones_BS, ones_BL = jnp.ones((b, s), jnp.int32), jnp.ones((b, l), jnp.int32)
    mask_BLS = attention_mask(ones_BL, ones_BS, q_index_BL, k_index_BS)
    return cached_k.value, cached_v.value, mask_BLS
