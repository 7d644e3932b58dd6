"""Error feedback + quantization in one pass: the reference and the Pallas kernel (interpreted) equal, bit for
bit, the composition of jaxtrain/optim/quantize.py's encode and decode that optim/compress.py's `ef` runs:
x = g + e, (payload, scales) = encode(x), e' = x - decode(payload, scales). Exact, so no tolerance.

The composition is compared jitted, as compress.py runs it: XLA then contracts x - q * s into an FMA
(docs/ARCHITECTURE.md, pitfalls), and the eagerly run composition's error differs from it in the last bit;
the kernel, jitted or not, and the jitted reference agree with the jitted composition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import wire
from jaxtrain.kernels import platform
from jaxtrain.kernels.quantize import ops, reference
from jaxtrain.optim import quantize


def _composition(g, error, fmt, block, scale):
  x = g if error is None else g + error
  payload, scales = quantize.encode(x, fmt, block, scale)
  return payload, scales, x - quantize.decode(payload, scales, fmt, block)


def _inputs(shape, block, seed):
  """Gradients whose magnitude changes by orders of magnitude from block to block, an error buffer, and a zero
  block (its scale is 1)."""
  rng = np.random.default_rng(seed)
  g = rng.standard_normal(shape).astype(np.float32)
  if shape[-1] % block == 0:
    mags = 10.0 ** rng.uniform(-4, 2, size=(*shape[:-1], shape[-1] // block, 1))
    g = (g.reshape(*shape[:-1], -1, block) * mags).reshape(shape)
    g.reshape(-1)[:block] = 0.0
  error = (1e-3 * rng.standard_normal(shape)).astype(np.float32)
  error.reshape(-1)[:block] = 0.0
  return jnp.asarray(g, jnp.float32), jnp.asarray(error)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("fmt,shape,block,rows_per_program,feedback", [
    ("int8", (3, 320), 32, 4, True),  # 30 blocks: the last program's rows are partial
    ("int4", (2, 96), 16, 8, True),  # 12 blocks
    ("int4", (640,), 64, 3, False),  # no error buffer
    ("fp8", (4, 100), 32, 8, True),  # 400 elements: not blocks of 32, rows of the last axis
    ("fp8", (256,), 32, 2, True),
    ("bf16", (5, 50), 16, 2, True),
    ("f32", (2, 64), 16, 3, True),
])
def test_kernel_and_reference_equal_the_composition_bitwise(fmt, shape, block, rows_per_program, feedback):
  g, error = _inputs(shape, block, seed=len(shape) + block)
  error = error if feedback else None
  x = g if error is None else g + error
  scale = wire.fp8.shared_scale(jnp.max(jnp.abs(x))) if fmt == "fp8" else None
  want = jax.jit(lambda g, e: _composition(g, e, fmt, block, scale))(g, error)
  run = lambda impl: lambda g, e: ops.quantize_with_feedback(g, e, fmt, block, scale, impl=impl,
                                                             rows_per_program=rows_per_program, interpret=True)
  for impl, got in [("xla", jax.jit(run("xla"))(g, error)), ("pallas", run("pallas")(g, error)),
                    ("pallas jitted", jax.jit(run("pallas"))(g, error))]:
    for name, a, b in zip(("payload", "scales", "error"), got, want):
      if b is None:
        assert a is None, (impl, name)
        continue
      assert a.dtype == b.dtype and a.shape == b.shape, (impl, name, a.dtype, b.dtype, a.shape, b.shape)
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{impl} {name}")
  if fmt != "f32":
    assert np.abs(np.asarray(want[2])).max() > 0  # it did quantize


@pytest.mark.parametrize("feedback", [True, False])
def test_int4_tpu_body_equals_the_composition_bitwise(feedback):
  """Mosaic cannot lower int4's strided loads: on TPU the kernel packs the bytes by a matmul
  (kernel._int4_by_matmul). Traced for TPU and interpreted here, it gives the same bits."""
  g, error = _inputs((4, 256), 128, seed=3)
  error = error if feedback else None
  want = jax.jit(lambda g, e: _composition(g, e, "int4", 128, None))(g, error)
  with platform.target("tpu"):
    got = jax.jit(lambda g, e: ops.quantize_with_feedback(g, e, "int4", 128, impl="pallas",
                                                          interpret=True))(g, error)
  for name, a, b in zip(("payload", "scales", "error"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


def test_round_half_even_is_jnp_round():
  """The kernel's rounding (floor and compares: Triton has no round) gives jnp.round's bits, ties included."""
  ties = np.arange(-20, 20, dtype=np.float32) + 0.5
  near = np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))
  rng = np.random.default_rng(0)
  big = np.float32(2.0 ** 23) + np.arange(-4, 5, dtype=np.float32)
  x = np.concatenate([ties, *near, rng.normal(0, 100, 4096).astype(np.float32), big, -big, [0.0, -0.0]])
  x = jnp.asarray(x.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(reference.round_half_even(x)), np.asarray(jnp.round(x)))
