"""What the block-scaled formats (int8, int4) share: each block (a last-axis row) has one float32
scale, its absmax / qmax (1 for a zero block), and int8 levels in [-qmax, qmax].
|x - q| <= absmax / (2 qmax)."""

import jax.numpy as jnp


def scales(absmax, qmax: int):
  return jnp.where(absmax > 0, absmax / qmax, 1.0)


def levels(x, scales_, qmax: int, rounding):
  """x [..., C] / its row's scale, rounded and clipped: int8 [..., C]."""
  return jnp.clip(rounding(x / scales_[..., None]), -qmax, qmax).astype(jnp.int8)


def quantize(x, qmax: int, rounding):
  s = scales(jnp.max(jnp.abs(x), axis=-1), qmax)
  return levels(x, s, qmax, rounding), s


def dequantize(q, scales_):
  return q.astype(jnp.float32) * scales_[..., None]
