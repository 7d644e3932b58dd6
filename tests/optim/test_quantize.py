"""Wire formats: each round-trips within its bound; int4 packing is lossless; payloads are as narrow
as claimed."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import wire
from jaxtrain.optim import quantize


def blocks_of_mixed_scale(shape=(4, 1024), block=256, seed=0):
  """Normal values whose magnitude changes by orders of magnitude from block to block."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  scale = 10.0 ** rng.uniform(-4, 2, size=(*shape[:-1], shape[-1] // block, 1))
  return (x.reshape(*shape[:-1], -1, block) * scale).reshape(shape).astype(np.float32)


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_block_formats_round_trip_within_half_a_step_of_their_block(fmt, qmax):
  x = blocks_of_mixed_scale()
  got = np.asarray(quantize.roundtrip(jnp.asarray(x), fmt, 256))
  absmax = np.abs(x.reshape(4, -1, 256)).max(-1, keepdims=True)
  err = np.abs(got - x).reshape(4, -1, 256)
  assert np.all(err <= absmax / (2 * qmax) * (1 + 1e-6))
  assert err.max() > 0  # it did quantize


def test_bf16_and_fp8_round_trip_within_their_relative_precision():
  x = blocks_of_mixed_scale(seed=1)
  bf16 = np.asarray(quantize.roundtrip(jnp.asarray(x), "bf16"))
  assert np.all(np.abs(bf16 - x) <= 2.0 ** -8 * np.abs(x))
  scale = wire.fp8.shared_scale(jnp.max(jnp.abs(x)))
  fp8 = np.asarray(quantize.roundtrip(jnp.asarray(x), "fp8", scale=scale))
  s = float(scale)
  assert np.all(np.abs(fp8 - x) <= 2.0 ** -4 * np.abs(x) + s * 2.0 ** -10)
  assert np.abs(fp8).max() == pytest.approx(np.abs(x).max(), rel=2 ** -4)  # the absmax maps inside the range
  np.testing.assert_array_equal(np.asarray(quantize.roundtrip(jnp.asarray(x), "f32")), x)


def test_int4_packing_is_lossless_on_representable_values():
  q = jnp.asarray(np.random.default_rng(2).integers(-8, 8, size=(3, 512)), jnp.int8)
  packed = wire.int4.pack(q)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 256)
  np.testing.assert_array_equal(np.asarray(wire.int4.unpack(packed)), np.asarray(q))
  # values on the grid of their block's scale come back exactly
  scale = np.float32(0.25)
  x = np.asarray(q, np.float32).clip(-7, 7) * scale
  x[:, 0] = 7 * scale  # every block's absmax is 7 steps
  x[:, 256] = -7 * scale
  np.testing.assert_array_equal(np.asarray(quantize.roundtrip(jnp.asarray(x), "int4", 256)), x)


@pytest.mark.parametrize("fmt,dtype,nbytes", [("f32", jnp.float32, 4 * 1024), ("bf16", jnp.uint16, 2 * 1024),
                                               ("fp8", jnp.uint8, 1024), ("int8", jnp.uint8, 1024),
                                               ("int4", jnp.uint8, 512)])
def test_payloads_are_as_narrow_as_their_format(fmt, dtype, nbytes):
  x = jnp.asarray(blocks_of_mixed_scale((1, 1024)))
  payload, scales = quantize.encode(x, fmt, 256, wire.fp8.shared_scale(jnp.max(jnp.abs(x))))
  assert payload.dtype == dtype and payload.size * payload.dtype.itemsize == nbytes
  assert (scales is not None and scales.size == 4) == (fmt in ("int8", "int4"))


def test_zero_blocks_and_zero_arrays_stay_zero():
  x = jnp.zeros((2, 512))
  for fmt in wire.FORMATS:
    got = quantize.roundtrip(x, fmt, 256, wire.fp8.shared_scale(jnp.float32(0)))
    assert not np.any(np.asarray(got)) and np.all(np.isfinite(np.asarray(got)))
