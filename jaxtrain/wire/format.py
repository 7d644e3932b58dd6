"""`Format`: one wire format, the arithmetic and the bits of one entry of `wire.FORMATS`."""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


def rounded(q):
  """q, held as computed. XLA:GPU folds a float round trip (f32 -> bf16 -> f32, f32 -> fp8 -> f32)
  to the identity (`xla_allow_excess_precision`), which made error feedback's x - decode(encode(x))
  zero for the bf16 and fp8 formats: the compiled HLO for an H100 held `subtract(x, x)`, and the
  H200 run of 2026-12-04 found the Pallas kernel's error 1.0 (bf16) and 15 (fp8) away from it
  (tests/targets/test_kernels.py holds both; XLA:TPU and XLA:CPU keep the rounding). An
  optimization barrier between quantize and dequantize keeps it. Not for use inside a Pallas
  kernel (its body has no barrier)."""
  return jax.lax.optimization_barrier(q)


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
