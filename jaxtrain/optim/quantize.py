"""A wire format (jaxtrain/wire) over blocks, composed in XLA: float32 [..., L] -> payload
(+ scales) -> float32. Blocks run along the last axis; block-scaled formats (int8, int4) carry one
float32 absmax scale per block, fp8 one scale for the whole call (agreed by the caller across
shards), bf16 and f32 none. Each format's round-trip bound is in its own file,
jaxtrain/wire/<format>.py."""

import jax.numpy as jnp

from jaxtrain import wire
from jaxtrain.wire.format import rounded


def _blocks(x, block: int):
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def encode(x, fmt: str, block: int = 256, scale=None):
  """float32 [..., L] -> (payload, scales). L must be a multiple of `block` for block-scaled
  formats. fp8 needs `scale` (its shared_scale of an absmax at least |x|'s); its scales output is
  that scale."""
  spec = wire.FORMATS[fmt]
  x = x.astype(jnp.float32)
  if not spec.block_scaled:
    q, scales = spec.quantize(x, scale)
    return spec.pack(rounded(q)), scales
  q, scales = spec.quantize(_blocks(x, block))
  return spec.pack(rounded(q)).reshape(*x.shape[:-1], spec.payload_size(x.shape[-1])), scales


def decode(payload, scales, fmt: str, block: int = 256):
  """(payload, scales) from `encode` -> float32 [..., L]."""
  spec = wire.FORMATS[fmt]
  q = spec.unpack(payload)
  if not spec.block_scaled:
    return spec.dequantize(q, scales)
  return spec.dequantize(_blocks(q, block), scales).reshape(q.shape)


def roundtrip(x, fmt: str, block: int = 256, scale=None):
  """decode(encode(x)): what the other side receives."""
  payload, scales = encode(x, fmt, block, scale)
  return decode(payload, scales, fmt, block)
