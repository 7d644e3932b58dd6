"""`Format`: one wire format, the arithmetic and the bits of one entry of `wire.FORMATS`."""

from typing import Callable, NamedTuple

import jax.numpy as jnp


class Format(NamedTuple):
  """float32 x [..., C] -> quantize -> q (+ scales) -> pack -> payload, and back by unpack and
  dequantize. `quantize(x, scale, rounding)` -> (q, scales); `dequantize(q, scales)` -> float32;
  `pack` / `unpack` are exact. A block-scaled format takes each last-axis row of x as one block."""
  bits: int  # per element on the wire
  payload: type  # the payload's dtype: unsigned (XLA:CPU widens bf16/fp8/s4 collectives) or f32
  quantize: Callable
  dequantize: Callable
  pack: Callable
  unpack: Callable
  block_scaled: bool = False  # one float32 absmax scale per block, sent beside the payload
  shared_scale: Callable | None = None  # absmax agreed by every shard -> the one scale of a call
  pallas: bool = True  # jaxtrain/kernels/quantize's one-pass Pallas kernel runs it

  def payload_size(self, n: int) -> int:
    """Payload elements that carry n values."""
    return n * self.bits // (8 * jnp.dtype(self.payload).itemsize)
