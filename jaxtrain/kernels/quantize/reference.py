"""Error feedback + quantization in plain jnp: x = g + e, (payload, scales) = encode(x), e' = x - decode(...),
in the wire formats of jaxtrain/optim/quantize.py (u16 bf16, u8 fp8 / int8 / packed int4, float32 absmax scales
per block for int8 and int4, one given scale for fp8). Kernels sit left of optim in the import order, so the
format arithmetic is written here once more, op for op; tests/kernels/test_quantize_kernel.py holds it and
the kernel bitwise to the composition of optim.quantize.encode and decode (optim/compress.py's `ef`)."""

import jax
import jax.numpy as jnp

FORMATS = ("f32", "bf16", "fp8", "int8", "int4")
FP8_MAX = 448.0
QMAX = {"int8": 127, "int4": 7}


def pack_int4(q):
  """int8 values in [-8, 7], [..., C] with C even -> uint8 [..., C/2], two per byte (low nibble first)."""
  nibbles = (q.astype(jnp.int32) + 8).astype(jnp.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
  return nibbles[..., 0] | (nibbles[..., 1] << 4)


def round_half_even(x):
  """jnp.round (to nearest, ties to even) from floor and compares: Pallas's Triton lowering has no round."""
  t = jnp.floor(x)
  d = x - t  # exact for |x| < 2**23; above that x is an integer already and d = 0
  odd = t - 2.0 * jnp.floor(t * 0.5) == 1.0
  return jnp.where((d > 0.5) | ((d == 0.5) & odd), t + 1.0, t)


def encode(x, fmt: str, scale=None, rounding=jnp.round):
  """float32 [..., C] (int8/int4: each last-axis row one block) -> (payload, scales [...] or None, decoded)."""
  if fmt == "f32":
    return x, None, x
  if fmt == "bf16":
    b = x.astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(b, jnp.uint16), None, b.astype(jnp.float32)
  if fmt == "fp8":
    q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scale, q.astype(jnp.float32) * scale
  qmax = QMAX[fmt]
  absmax = jnp.max(jnp.abs(x), axis=-1)
  scales = jnp.where(absmax > 0, absmax / qmax, 1.0)
  q = jnp.clip(rounding(x / scales[..., None]), -qmax, qmax).astype(jnp.int8)
  decoded = q.astype(jnp.float32) * scales[..., None]
  payload = jax.lax.bitcast_convert_type(q, jnp.uint8) if fmt == "int8" else pack_int4(q)
  return payload, scales, decoded


def quantize_with_feedback(g, error, fmt: str, block: int = 256, scale=None):
  """g, error float32 [..., L] (error None = no feedback; int8/int4: L a multiple of `block`) ->
  (payload [..., L or L/2], scales [..., L/block] / the fp8 scale / None, new error [..., L] float32)."""
  x = g.astype(jnp.float32) if error is None else g.astype(jnp.float32) + error
  shape = x.shape
  if fmt in QMAX:
    x = x.reshape(*shape[:-1], shape[-1] // block, block)
  payload, scales, decoded = encode(x, fmt, scale)
  cols = shape[-1] // 2 if fmt == "int4" else shape[-1]
  return payload.reshape(*shape[:-1], cols), scales, (x - decoded).reshape(shape)
