"""flash_attention: the Pallas kernels behind a custom_vjp, with the padding they need; interpreted
on CPU.

Same contract as reference.attention (segment ids, token indices, GQA, zeros for rows that see no
key).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.kernels.flash_attention import kernel
from jaxtrain.kernels import platform


def flash_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, *,
                    block_q=128, block_k=128, interpret=None):
  """Softmax(q k^T / sqrt(K)) v by key blocks, never materializing [L, S]; out in q's dtype.

  Blocks are powers of two (Triton's tiles), shrunk for short inputs; `interpret` defaults to True
  on CPU.
  """
  h, g = q_BLHK.shape[2], k_BSGK.shape[2]
  if h % g:
    raise ValueError(f"query heads {h} are not a multiple of kv heads {g}")
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if block < 16 or block & (block - 1):
      raise ValueError(f"{name}={block} must be a power of two >= 16")
  if interpret is None:
    interpret = platform.backend() == "cpu"
  if not interpret and platform.backend() == "tpu":
    raise ValueError("flash_attention: a Triton kernel (GPU; interpreted on CPU): its [B, L, H, K] "
                     "blocks do not tile as Mosaic needs; on TPU use splash "
                     "(model/attention.splash_attention)")
  block_q = min(block_q, _tile(q_BLHK.shape[1]))
  block_k = min(block_k, _tile(k_BSGK.shape[1]))
  return _flash(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, block_q,
                block_k, bool(interpret))


def _tile(n):
  return max(16, pl.next_power_of_2(n))


def _pad(x, axis, size):
  """Zero-pad axis of x up to size (padding tokens get segment 0, so no query attends them)."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _padded(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, block_q,
            block_k):
  """Lengths up to a multiple of the blocks, head dim up to a power of two
  (zero columns leave q k^T as is)."""
  l, s, kd = q_BLHK.shape[1], k_BSGK.shape[1], q_BLHK.shape[3]
  lp, sp, kp = pl.cdiv(l, block_q) * block_q, pl.cdiv(s, block_k) * block_k, _tile(kd)
  q, k, v = _pad(_pad(q_BLHK, 1, lp), 3, kp), _pad(_pad(k_BSGK, 1, sp), 3,
                                                   kp), _pad(_pad(v_BSGK, 1, sp), 3, kp)
  return q, k, v, _pad(q_segment_BL, 1, lp), _pad(k_segment_BS, 1,
                                                  sp), _pad(q_index_BL, 1,
                                                            lp), _pad(k_index_BS, 1, sp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, block_q,
           block_k, interpret):
  return _forward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                  block_q, block_k, interpret)[0]


def _forward(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, block_q,
             block_k, interpret):
  inputs = (q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)
  l, kd = q_BLHK.shape[1], q_BLHK.shape[3]
  out_BLHK, lse_BHL = kernel.forward(*_padded(*inputs, block_q, block_k), scale=1.0 / math.sqrt(kd),
                                     block_q=block_q, block_k=block_k, interpret=interpret)
  return out_BLHK[:, :l, :, :kd], (inputs, out_BLHK, lse_BHL)


def _backward(block_q, block_k, interpret, residuals, dout_BLHK):
  """Padding again is cheaper than keeping padded copies;
  delta = rowsum(out * dout) is one XLA fusion."""
  inputs, out_BLHK, lse_BHL = residuals
  l, s, kd = inputs[0].shape[1], inputs[1].shape[1], inputs[0].shape[3]
  padded = _padded(*inputs, block_q, block_k)
  # The kernel's dots take operands of one dtype: the cotangent comes in q's.
  do_BLHK = _pad(_pad(dout_BLHK.astype(inputs[0].dtype), 1, out_BLHK.shape[1]), 3,
                 out_BLHK.shape[3])
  delta_BHL = jnp.einsum("BLHK,BLHK->BHL", out_BLHK.astype(jnp.float32),
                         do_BLHK.astype(jnp.float32))
  dq, dk, dv = kernel.backward(*padded, do_BLHK, lse_BHL, delta_BHL, scale=1.0 / math.sqrt(kd),
                               block_q=block_q, block_k=block_k, interpret=interpret)
  return dq[:, :l, :, :kd], dk[:, :s, :, :kd], dv[:, :s, :, :kd], None, None, None, None


_flash.defvjp(_forward, _backward)
