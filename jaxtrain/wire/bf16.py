"""bf16: round to nearest bfloat16, sent as its bits (u16). |x - q| <= 2^-8 |x|."""

import jax
import jax.numpy as jnp

from jaxtrain.wire.format import Format


def quantize(x, scale=None, rounding=jnp.round):
  del scale, rounding
  return x.astype(jnp.bfloat16), None


def dequantize(q, scales):
  del scales
  return q.astype(jnp.float32)


def pack(q):
  return jax.lax.bitcast_convert_type(q, jnp.uint16)


def unpack(payload):
  return jax.lax.bitcast_convert_type(payload, jnp.bfloat16)


FORMAT = Format(16, jnp.uint16, quantize, dequantize, pack, unpack)
