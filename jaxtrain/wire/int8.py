"""int8: 255 levels per block of the block's absmax, sent as u8. |x - q| <= absmax / 254."""

import jax
import jax.numpy as jnp

from jaxtrain.wire import blocks
from jaxtrain.wire.format import Format

QMAX = 127


def quantize(x, scale=None, rounding=jnp.round):
  del scale
  return blocks.quantize(x, QMAX, rounding)


def pack(q):
  return jax.lax.bitcast_convert_type(q, jnp.uint8)


def unpack(payload):
  return jax.lax.bitcast_convert_type(payload, jnp.int8)


FORMAT = Format(8, jnp.uint8, quantize, blocks.dequantize, pack, unpack, block_scaled=True)
