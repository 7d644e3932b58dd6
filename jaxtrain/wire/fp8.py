"""fp8: float8 e4m3 of x / scale, one scale for the whole call that the caller agrees across shards
first (`shared_scale` of the shards' absmax), sent as its bits (u8).
|x - q| <= 2^-4 |x| (normal range) + scale * 2^-10."""

import jax
import jax.numpy as jnp

from jaxtrain.wire.format import Format

FP8_MAX = 448.0  # largest float8_e4m3fn


def shared_scale(absmax):
  """The scale that maps `absmax` (agreed by every shard) to e4m3's largest value."""
  return jnp.where(absmax > 0, absmax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize(x, scale, rounding=jnp.round):
  del rounding  # the cast rounds to nearest
  return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


def dequantize(q, scales):
  return q.astype(jnp.float32) * scales


def pack(q):
  return jax.lax.bitcast_convert_type(q, jnp.uint8)


def unpack(payload):
  return jax.lax.bitcast_convert_type(payload, jnp.float8_e4m3fn)


FORMAT = Format(8, jnp.uint8, quantize, dequantize, pack, unpack, shared_scale=shared_scale)
