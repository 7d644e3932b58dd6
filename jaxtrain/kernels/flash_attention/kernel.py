"""Flash attention as Pallas kernels: forward (online softmax, saves the logsumexp), dq, and dk/dv.

FlashAttention-2 (Dao, 2023, arxiv.org/abs/2307.08691), written GPU-style (grid + BlockSpecs,
lowered by Triton) and interpreted on CPU. Masks come from segment ids and token indices
(reference.mask), so rows may be packed and permuted. Grouped-query attention maps each query head h
to kv head h // R in the index maps: K and V are never repeated. Shapes here are already padded by
ops.py: lengths to a multiple of the block (padding has segment 0), head dim to a power of two; lse
and delta are [B, H, L] float32.
"""

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.kernels import compiler, manual

# Finite: a row whose keys in a tile are all masked keeps a finite running max, so its correction
# exp(m - m_next) is never exp(-inf + inf) = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _mask(q_segment, k_segment, q_index, k_index):
  """[block_q, block_k]: same non-padding segment, key not after the query
  (reference.mask for one tile)."""
  same = (q_segment[:, None] == k_segment[None, :]) & (k_segment[None, :] > 0)
  return same & (k_index[None, :] <= q_index[:, None])


def _any(mask):
  """Whether a tile has a key to attend: tiles with none (causally future, other documents, padding)
  are skipped."""
  return jnp.max(mask.astype(jnp.int32)) > 0


def _dot(a, b):
  """a @ b accumulated in float32 (bf16 operands stay bf16, as the tensor cores take them)."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _forward_kernel(q_ref, k_ref, v_ref, q_segment_ref, k_segment_ref, q_index_ref, k_index_ref,
                    o_ref, lse_ref, *, scale, block_k):
  """One query block of one head against every key block of its kv head."""
  q, q_segment, q_index = q_ref[...], q_segment_ref[...], q_index_ref[...]
  block_q, head_dim = q.shape

  def body(j, carry):
    keys = pl.ds(j * block_k, block_k)
    mask = _mask(q_segment, k_segment_ref[keys], q_index, k_index_ref[keys])

    def attend(carry):
      o, m, l = carry
      k, v = k_ref[keys, :], v_ref[keys, :]
      s = jnp.where(mask, scale * _dot(q, k.T), MASK_VALUE)
      m_next = jnp.maximum(m, jnp.max(s, axis=1))
      correction = jnp.exp(m - m_next)
      p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
      l = correction * l + jnp.sum(p, axis=1)
      return correction[:, None] * o + _dot(p.astype(v.dtype), v), m_next, l

    return lax.cond(_any(mask), attend, lambda carry: carry, carry)

  init = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  o, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, init)
  seen = l > 0.0  # a row that may attend no key gets zeros, and lse = log 0 = -inf
  o_ref[...] = (o / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _probs(q, k, lse, mask, scale):
  """Recomputed softmax tile exp(s - lse), zero where masked (rows that saw no key are masked
  throughout)."""
  return jnp.where(mask, jnp.exp(scale * _dot(q, k.T) - lse[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, q_segment_ref, k_segment_ref, q_index_ref, k_index_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, scale, block_k):
  """dq for one query block of one head: sum over key blocks of dS k,
  with dS = P * (dO v^T - delta)."""
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_segment, q_index = q_segment_ref[...], q_index_ref[...]

  def body(j, dq):
    keys = pl.ds(j * block_k, block_k)
    mask = _mask(q_segment, k_segment_ref[keys], q_index, k_index_ref[keys])

    def attend(dq):
      k, v = k_ref[keys, :], v_ref[keys, :]
      p = _probs(q, k, lse, mask, scale)
      ds = p * (_dot(do, v.T) - delta[:, None])
      return dq + _dot(ds.astype(k.dtype), k)

    return lax.cond(_any(mask), attend, lambda dq: dq, dq)

  dq = lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (scale * dq).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, q_segment_ref, k_segment_ref, q_index_ref, k_index_ref,
                 do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, block_q):
  """dk, dv for one key block of one kv head,
  summed over its R query heads and every query block."""
  k, v, k_segment, k_index = k_ref[...], v_ref[...], k_segment_ref[...], k_index_ref[...]
  n_q, heads = q_ref.shape[0] // block_q, q_ref.shape[1]

  def body(t, carry):
    r, queries = lax.div(t, n_q), pl.ds(lax.rem(t, n_q) * block_q, block_q)
    mask = _mask(q_segment_ref[queries], k_segment, q_index_ref[queries], k_index)

    def attend(carry):
      dk, dv = carry
      q, do = q_ref[queries, r, :], do_ref[queries, r, :]
      lse, delta = lse_ref[r, queries], delta_ref[r, queries]
      p = _probs(q, k, lse, mask, scale)
      dv = dv + _dot(p.astype(do.dtype).T, do)
      ds = p * (_dot(do, v.T) - delta[:, None])
      return dk + _dot(ds.astype(q.dtype).T, q), dv

    return lax.cond(_any(mask), attend, lambda carry: carry, carry)

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(0, heads * n_q, body, init)
  dk_ref[...] = (scale * dk).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(block_q, block_k, interpret):
  return compiler.params(3, interpret, num_warps=4 if block_q * block_k <= 64 * 64 else 8)


def forward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, *, scale,
            block_q, block_k, interpret):
  """(out [B, L, H, K] in q's dtype, lse [B, H, L] float32); grid (query blocks, B, H)."""
  b, l, h, kd = q_BLHK.shape
  s, g = k_BSGK.shape[1], k_BSGK.shape[2]
  r = h // g
  q_spec = pl.BlockSpec((None, block_q, None, kd), lambda i, bi, hi: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, s, None, kd), lambda i, bi, hi: (bi, 0, hi // r, 0))
  q_row = pl.BlockSpec((None, block_q), lambda i, bi, hi: (bi, i))
  k_row = pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
  return pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, block_k=block_k),
      grid=(l // block_q, b, h),
      in_specs=[q_spec, kv_spec, kv_spec, q_row, k_row, q_row, k_row],
      out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda i, bi, hi: (bi, hi, i))],
      out_shape=[manual.like(q_BLHK.shape, q_BLHK.dtype, q_BLHK),
                 manual.like((b, h, l), jnp.float32, q_BLHK)],
      compiler_params=_compiler_params(block_q, block_k, interpret),
      interpret=interpret,
      name="flash_attention_forward",
  )(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)


def backward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, do_BLHK,
             lse_BHL, delta_BHL, *, scale, block_q, block_k, interpret):
  """(dq, dk, dv) from the saved lse and delta = rowsum(out * dout):
  a dq kernel and a dk/dv kernel."""
  b, l, h, kd = q_BLHK.shape
  s, g = k_BSGK.shape[1], k_BSGK.shape[2]
  r = h // g
  args = (q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, do_BLHK,
          lse_BHL, delta_BHL)
  params = _compiler_params(block_q, block_k, interpret)

  # dq: grid (query blocks, B, H), each program loops over all key blocks of its kv head.
  q_spec = pl.BlockSpec((None, block_q, None, kd), lambda i, bi, hi: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, s, None, kd), lambda i, bi, hi: (bi, 0, hi // r, 0))
  q_row = pl.BlockSpec((None, block_q), lambda i, bi, hi: (bi, i))
  k_row = pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
  stat = pl.BlockSpec((None, None, block_q), lambda i, bi, hi: (bi, hi, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, block_k=block_k),
      grid=(l // block_q, b, h),
      in_specs=[q_spec, kv_spec, kv_spec, q_row, k_row, q_row, k_row, q_spec, stat, stat],
      out_specs=q_spec,
      out_shape=manual.like(q_BLHK.shape, q_BLHK.dtype, q_BLHK),
      compiler_params=params,
      interpret=interpret,
      name="flash_attention_dq",
  )(*args)

  # dk, dv: grid (key blocks, B, G), each program loops over the R query heads of its group and all
  # query blocks.
  q_spec = pl.BlockSpec((None, l, r, kd), lambda j, bi, gi: (bi, 0, gi, 0))
  kv_spec = pl.BlockSpec((None, block_k, None, kd), lambda j, bi, gi: (bi, j, gi, 0))
  q_row = pl.BlockSpec((None, l), lambda j, bi, gi: (bi, 0))
  k_row = pl.BlockSpec((None, block_k), lambda j, bi, gi: (bi, j))
  stat = pl.BlockSpec((None, r, l), lambda j, bi, gi: (bi, gi, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, block_q=block_q),
      grid=(s // block_k, b, g),
      in_specs=[q_spec, kv_spec, kv_spec, q_row, k_row, q_row, k_row, q_spec, stat, stat],
      out_specs=[kv_spec, kv_spec],
      out_shape=[manual.like(k_BSGK.shape, k_BSGK.dtype, k_BSGK),
                 manual.like(v_BSGK.shape, v_BSGK.dtype, k_BSGK)],
      compiler_params=params,
      interpret=interpret,
      name="flash_attention_dkdv",
  )(*args)
  return dq, dk, dv
