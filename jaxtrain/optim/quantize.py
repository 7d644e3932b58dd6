"""Wire formats for compressed collectives: float32 -> narrow payload (+ scales) -> float32.

Every payload is an unsigned integer array (u16 for bf16, u8 for fp8, int8 and packed int4), so that a
collective moves exactly the bytes the format claims: XLA:CPU widens bf16/fp8/s4 collectives, but not
u8/u16 (docs/ARCHITECTURE.md, pitfalls). Blocks run along the last axis; int8 and int4 carry one
float32 absmax scale per block, fp8 one scale for the whole call (agreed by the caller across shards),
bf16 and f32 none.

Error bounds (round to nearest), per element x of a block with absmax a:
  bf16  |x - q| <= 2^-8 |x|            fp8 (e4m3)  |x - q| <= 2^-4 |x| (normal range) + scale * 2^-10
  int8  |x - q| <= a / 254             int4        |x - q| <= a / 14
"""

import jax
import jax.numpy as jnp

FORMATS = ("f32", "bf16", "fp8", "int8", "int4")
BITS = {"f32": 32, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
FP8_MAX = 448.0  # largest float8_e4m3fn
_QMAX = {"int8": 127, "int4": 7}


def has_block_scales(fmt: str) -> bool:
  return fmt in _QMAX


def fp8_scale(absmax):
  """The fp8 scale that maps `absmax` (agreed by every shard) to e4m3's largest value."""
  return jnp.where(absmax > 0, absmax / FP8_MAX, 1.0).astype(jnp.float32)


def encode(x, fmt: str, block: int = 256, scale=None):
  """float32 [..., L] -> (payload, scales). L must be a multiple of `block` for int8/int4. fp8 needs
  `scale` (fp8_scale of an absmax at least |x|'s); its scales output is that scale."""
  x = x.astype(jnp.float32)
  if fmt == "f32":
    return x, None
  if fmt == "bf16":
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), None
  if fmt == "fp8":
    q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scale
  qmax = _QMAX[fmt]
  blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  scales = jnp.where(absmax > 0, absmax / qmax, 1.0)
  q = jnp.clip(jnp.round(blocks / scales[..., None]), -qmax, qmax).astype(jnp.int8).reshape(x.shape)
  if fmt == "int8":
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scales
  return pack_int4(q), scales


def decode(payload, scales, fmt: str, block: int = 256):
  """(payload, scales) from `encode` -> float32 [..., L]."""
  if fmt == "f32":
    return payload
  if fmt == "bf16":
    return jax.lax.bitcast_convert_type(payload, jnp.bfloat16).astype(jnp.float32)
  if fmt == "fp8":
    return jax.lax.bitcast_convert_type(payload, jnp.float8_e4m3fn).astype(jnp.float32) * scales
  q = jax.lax.bitcast_convert_type(payload, jnp.int8) if fmt == "int8" else unpack_int4(payload)
  blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], q.shape[-1] // block, block)
  return (blocks * scales[..., None]).reshape(q.shape)


def pack_int4(q):
  """int8 values in [-8, 7], [..., L] with L even -> uint8 [..., L/2], two per byte (low nibble first)."""
  nibbles = (q.astype(jnp.int32) + 8).astype(jnp.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
  return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(packed):
  """The inverse of pack_int4: uint8 [..., L/2] -> int8 [..., L]."""
  low = (packed & 0xF).astype(jnp.int8) - 8
  high = (packed >> 4).astype(jnp.int8) - 8
  return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def roundtrip(x, fmt: str, block: int = 256, scale=None):
  """decode(encode(x)): what the other side receives."""
  payload, scales = encode(x, fmt, block, scale)
  return decode(payload, scales, fmt, block)
