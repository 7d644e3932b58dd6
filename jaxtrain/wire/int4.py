"""int4: 15 levels per block of the block's absmax, two per byte (u8, low nibble first).
|x - q| <= absmax / 14."""

import jax.numpy as jnp

from jaxtrain.wire import blocks
from jaxtrain.wire.format import Format

QMAX = 7


def quantize(x, scale=None, rounding=jnp.round):
  del scale
  return blocks.quantize(x, QMAX, rounding)


def join(low, high):
  """int8 values in [-8, 7] of the even and the odd columns -> their bytes (low nibble first)."""
  low, high = [(q.astype(jnp.int32) + 8).astype(jnp.uint8) for q in (low, high)]
  return low | (high << 4)


def pack(q):
  """int8 values in [-8, 7], [..., C] with C even -> uint8 [..., C/2]."""
  pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
  return join(pairs[..., 0], pairs[..., 1])


def unpack(payload):
  """The inverse of pack: uint8 [..., C/2] -> int8 [..., C]."""
  low = (payload & 0xF).astype(jnp.int8) - 8
  high = (payload >> 4).astype(jnp.int8) - 8
  return jnp.stack([low, high], axis=-1).reshape(*payload.shape[:-1], payload.shape[-1] * 2)


FORMAT = Format(4, jnp.uint8, quantize, blocks.dequantize, pack, unpack, block_scaled=True)
