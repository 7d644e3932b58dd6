"""Error feedback + quantization in plain jnp: x = g + e, (payload, scales) = encode(x),
e' = x - decode(...), in the wire formats of jaxtrain/wire (their arithmetic, op for op).
tests/kernels/test_quantize_kernel.py holds it and the kernel bitwise to the composition of
optim.quantize.encode and decode (optim/compress.py's `ef`)."""

import jax.numpy as jnp

from jaxtrain import wire
from jaxtrain.wire.format import rounded


def round_half_even(x):
  """jnp.round (to nearest, ties to even) from floor and compares: Pallas's Triton lowering has no
  round."""
  t = jnp.floor(x)
  d = x - t  # exact for |x| < 2**23; above that x is an integer already and d = 0
  odd = t - 2.0 * jnp.floor(t * 0.5) == 1.0
  return jnp.where((d > 0.5) | ((d == 0.5) & odd), t + 1.0, t)


def encode(x, fmt: str, scale=None, rounding=jnp.round, in_kernel=False):
  """float32 [..., C] (block-scaled formats: each last-axis row one block) -> (payload, scales
  [...] / the shared scale / None, decoded). Outside a kernel q passes `wire.format.rounded`, so
  XLA cannot fold its rounding away; a Pallas kernel's body (`in_kernel`) has no barrier."""
  spec = wire.FORMATS[fmt]
  q, scales = spec.quantize(x, scale, rounding)
  if not in_kernel:
    q = rounded(q)
  return spec.pack(q), scales, spec.dequantize(q, scales)


def quantize_with_feedback(g, error, fmt: str, block: int = 256, scale=None):
  """g, error float32 [..., L] (error None = no feedback; block-scaled: L a multiple of `block`) ->
  (payload [..., L or L/2], scales [..., L/block] / the fp8 scale / None, new error [..., L])."""
  spec = wire.FORMATS[fmt]
  x = g.astype(jnp.float32) if error is None else g.astype(jnp.float32) + error
  shape = x.shape
  if spec.block_scaled:
    x = x.reshape(*shape[:-1], shape[-1] // block, block)
  payload, scales, decoded = encode(x, fmt, scale)
  cols = spec.payload_size(shape[-1])
  return payload.reshape(*shape[:-1], cols), scales, (x - decoded).reshape(shape)
