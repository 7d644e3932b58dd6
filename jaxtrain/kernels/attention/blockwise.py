"""Memory-efficient attention in plain JAX: an online softmax over blocks of keys (Rabe & Staats,
2021, "Self-attention does not need O(n^2) memory"; Dao et al., 2022, FlashAttention), forward and
backward.

Same contract as `reference.attention` (segment ids, causal by token index, zeros for a query that
may attend no key). The forward keeps only the output and the log-sum-exp of each query; the
backward recomputes each block's scores from them, so no [L, S] array exists in either pass:
temporaries are [L, block] per key block. Queries are not blocked (their count only scales each
block linearly). Every block is computed, none skipped: which blocks are fully masked depends on the
indices' values.

Each scan step reads its key block through `jax.lax.optimization_barrier`: without it XLA:TPU
computed the mask of every block before the loop (a [blocks, B, G, R, L, block] boolean, the whole
L x S mask: 2 of long_32k's 2.49 GiB a chip; 0.48 GiB with the barrier). XLA:CPU runs the same
speed either way.
"""

import functools

import jax
import jax.numpy as jnp

from jaxtrain.kernels import manual
from jaxtrain.kernels.attention import reference


def attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, *,
              block=512):
  """`reference.attention` computed `block` keys at a time; S need not be a multiple of `block`."""
  s = k_BSGK.shape[1]
  block = min(block, s)
  pad = -s % block
  if pad:  # padded keys get segment 0: masked for every query
    k_BSGK, v_BSGK = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k_BSGK, v_BSGK))
    k_segment_BS = jnp.pad(k_segment_BS, ((0, 0), (0, pad)))
    k_index_BS = jnp.pad(k_index_BS, ((0, 0), (0, pad)))
  return _attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                    block)


def _blocks(x_BS, block):
  """[B, S, ...] -> [S / block, B, block, ...]: the scan runs over the leading axis."""
  b, s = x_BS.shape[:2]
  return jnp.moveaxis(x_BS.reshape(b, s // block, block, *x_BS.shape[2:]), 1, 0)


def _unblocks(x_NBS):
  """Inverse of `_blocks`."""
  n, b, block = x_NBS.shape[:3]
  return jnp.moveaxis(x_NBS, 0, 1).reshape(b, n * block, *x_NBS.shape[3:])


def _scores(q_BLGRK, k_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS):
  """One block's scaled float32 scores and its mask, [B, G, R, L, S] and [B, 1, 1, L, S]."""
  scale = 1.0 / jnp.sqrt(jnp.float32(q_BLGRK.shape[-1]))
  scores_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                            preferred_element_type=jnp.float32) * scale
  return scores_BGRLS, reference.mask(q_segment_BL, k_segment_BS, q_index_BL,
                                      k_index_BS)[:, None, None]


def _varying_like(tree, *refs):
  """Scan carries that vary over the manual mesh axes the inputs vary over: inside a shard_map
  (context parallelism) a carry must start with the type it ends with (a cast of types, no
  communication)."""
  axes = tuple(sorted(set().union(*(manual.varying_axes(r) for r in refs))))
  return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree) if axes else tree


def _forward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, block):
  """Output [B, L, H, K] in q's dtype and the log-sum-exp of each query's scores [B, G, R, L]
  (0 if none)."""
  b, l, h, kd = q_BLHK.shape
  g = k_BSGK.shape[2]
  q_BLGRK = q_BLHK.reshape(b, l, g, h // g, kd)

  def step(carry, kv):
    max_BGRL, sum_BGRL, acc_BLGRK = carry
    k_BSGK, v_BSGK, k_segment_BS, k_index_BS = jax.lax.optimization_barrier(kv)
    scores_BGRLS, mask_BGRLS = _scores(q_BLGRK, k_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                                       k_index_BS)
    new_max_BGRL = jnp.maximum(max_BGRL,
                               jnp.max(jnp.where(mask_BGRLS, scores_BGRLS, -jnp.inf), axis=-1))
    # no key yet: avoid inf - inf
    safe_max_BGRL = jnp.where(jnp.isneginf(new_max_BGRL), 0.0, new_max_BGRL)
    probs_BGRLS = jnp.where(mask_BGRLS, jnp.exp(scores_BGRLS - safe_max_BGRL[..., None]), 0.0)
    correction_BGRL = jnp.exp(max_BGRL - safe_max_BGRL)
    sum_BGRL = sum_BGRL * correction_BGRL + jnp.sum(probs_BGRLS, axis=-1)
    pv_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", probs_BGRLS.astype(v_BSGK.dtype), v_BSGK,
                          preferred_element_type=jnp.float32)
    acc_BLGRK = acc_BLGRK * jnp.einsum("BGRL->BLGR", correction_BGRL)[..., None] + pv_BLGRK
    return (new_max_BGRL, sum_BGRL, acc_BLGRK), None

  init = (jnp.full((b, g, h // g, l), -jnp.inf, jnp.float32),
          jnp.zeros((b, g, h // g, l), jnp.float32),
          jnp.zeros((b, l, g, h // g, kd), jnp.float32))
  init = _varying_like(init, q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                       k_index_BS)
  kv = tuple(_blocks(x, block) for x in (k_BSGK, v_BSGK, k_segment_BS, k_index_BS))
  (max_BGRL, sum_BGRL, acc_BLGRK), _ = jax.lax.scan(step, init, kv)
  attended_BGRL = sum_BGRL > 0
  inv_BLGR = jnp.einsum(
      "BGRL->BLGR", jnp.where(attended_BGRL, 1.0 / jnp.where(attended_BGRL, sum_BGRL, 1.0), 0.0))
  out_BLHK = (acc_BLGRK * inv_BLGR[..., None]).reshape(b, l, h, kd).astype(q_BLHK.dtype)
  lse_BGRL = jnp.where(attended_BGRL,
                       max_BGRL + jnp.log(jnp.where(attended_BGRL, sum_BGRL, 1.0)), 0.0)
  return out_BLHK, lse_BGRL


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, block):
  return _forward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                  block)[0]


def _attention_fwd(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                   block):
  out_BLHK, lse_BGRL = _forward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                                k_index_BS, block)
  return out_BLHK, (q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                    out_BLHK, lse_BGRL)


def _attention_bwd(block, residuals, dout_BLHK):
  """Per key block: probabilities from the saved log-sum-exp,
  then dv, dk and this block's share of dq."""
  (q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, out_BLHK,
   lse_BGRL) = residuals
  b, l, h, kd = q_BLHK.shape
  g = k_BSGK.shape[2]
  scale = 1.0 / jnp.sqrt(jnp.float32(kd))
  q_BLGRK = q_BLHK.reshape(b, l, g, h // g, kd)
  dout_BLGRK = dout_BLHK.reshape(b, l, g, h // g, kd)
  delta_BGRL = jnp.einsum("BLGRK,BLGRK->BGRL", dout_BLGRK.astype(jnp.float32),
                          out_BLHK.reshape(b, l, g, h // g, kd).astype(jnp.float32))

  def step(dq_BLGRK, kv):
    k_BSGK, v_BSGK, k_segment_BS, k_index_BS = jax.lax.optimization_barrier(kv)
    scores_BGRLS, mask_BGRLS = _scores(q_BLGRK, k_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                                       k_index_BS)
    probs_BGRLS = jnp.where(mask_BGRLS, jnp.exp(scores_BGRLS - lse_BGRL[..., None]), 0.0)
    dv_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", probs_BGRLS.astype(dout_BLGRK.dtype), dout_BLGRK,
                         preferred_element_type=jnp.float32)
    dprobs_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", dout_BLGRK, v_BSGK,
                              preferred_element_type=jnp.float32)
    dscores_BGRLS = (probs_BGRLS * (dprobs_BGRLS - delta_BGRL[..., None]) * scale).astype(
        q_BLGRK.dtype)
    dq_BLGRK = dq_BLGRK + jnp.einsum("BGRLS,BSGK->BLGRK", dscores_BGRLS, k_BSGK,
                                     preferred_element_type=jnp.float32)
    dk_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", dscores_BGRLS, q_BLGRK,
                         preferred_element_type=jnp.float32)
    return dq_BLGRK, (dk_BSGK.astype(k_BSGK.dtype), dv_BSGK.astype(v_BSGK.dtype))

  kv = tuple(_blocks(x, block) for x in (k_BSGK, v_BSGK, k_segment_BS, k_index_BS))
  dq_BLGRK = _varying_like(jnp.zeros((b, l, g, h // g, kd), jnp.float32), q_BLHK, k_BSGK, v_BSGK,
                           dout_BLHK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)
  dq_BLGRK, (dk_NBSGK, dv_NBSGK) = jax.lax.scan(step, dq_BLGRK, kv)
  dq_BLHK = dq_BLGRK.reshape(b, l, h, kd).astype(q_BLHK.dtype)
  return dq_BLHK, _unblocks(dk_NBSGK), _unblocks(dv_NBSGK), None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
