"""Every entry of wire.FORMATS: round trip within the bound its file states, a payload of its dtype
and exactly `bits` per element, and the same table read by the XLA composition (optim.quantize),
the kernel's reference and Pallas kernel (interpreted), the compressed reduction, the planner's
byte counts and the format check of optim.build."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import config as config_lib, optim, wire
from jaxtrain.kernels.quantize import ops
from jaxtrain.optim import compress, quantize
from jaxtrain.plan import estimate
from tests.fixtures import tiny_config
from tests.optim.test_quantize import blocks_of_mixed_scale

BLOCK = 256
# |x - q| per element, of x, its block's absmax and the call's shared scale (the format files' docs)
BOUNDS = {
    "f32": lambda x, absmax, scale: 0.0 * x,
    "bf16": lambda x, absmax, scale: 2.0 ** -8 * np.abs(x),
    "fp8": lambda x, absmax, scale: 2.0 ** -4 * np.abs(x) + scale * 2.0 ** -10,
    "int8": lambda x, absmax, scale: absmax / 254 * (1 + 1e-6),
    "int4": lambda x, absmax, scale: absmax / 14 * (1 + 1e-6),
}


def _scale(spec, x):
  return None if spec.shared_scale is None else spec.shared_scale(jnp.max(jnp.abs(x)))


def _bits(a):
  return np.atleast_1d(np.asarray(a)).view(np.uint8)


def test_every_format_has_a_stated_bound():
  assert set(BOUNDS) == set(wire.FORMATS)


@pytest.mark.parametrize("name", tuple(wire.FORMATS))
def test_round_trip_within_its_bound(name):
  spec = wire.FORMATS[name]
  x = jnp.asarray(blocks_of_mixed_scale(seed=3))
  scale = _scale(spec, x)
  got = np.asarray(quantize.roundtrip(x, name, BLOCK, scale))
  x = np.asarray(x)
  absmax = np.abs(x.reshape(4, -1, BLOCK)).max(-1, keepdims=True)
  bound = BOUNDS[name](x.reshape(4, -1, BLOCK), absmax, 0.0 if scale is None else float(scale))
  err = np.abs(got - x).reshape(4, -1, BLOCK)
  assert np.all(err <= bound), (name, (err - bound).max())
  assert (err.max() > 0) == (spec.bits < 32)  # it did quantize, f32 excepted


@pytest.mark.parametrize("name", tuple(wire.FORMATS))
def test_payload_is_its_dtype_and_bits_per_element(name):
  spec = wire.FORMATS[name]
  x = jnp.asarray(blocks_of_mixed_scale((2, 1024)))
  payload, scales = quantize.encode(x, name, BLOCK, _scale(spec, x))
  assert payload.dtype == jnp.dtype(spec.payload)
  assert payload.shape == (2, spec.payload_size(1024))
  assert payload.size * payload.dtype.itemsize * 8 == spec.bits * x.size
  if spec.block_scaled:
    assert scales.dtype == jnp.float32 and scales.shape == (2, 1024 // BLOCK)
  elif spec.shared_scale is not None:
    assert scales.shape == ()
  else:
    assert scales is None
  np.testing.assert_array_equal(np.asarray(spec.unpack(spec.pack(spec.unpack(payload)))),
                                np.asarray(spec.unpack(payload)))  # pack and unpack are exact


@pytest.mark.parametrize("name", tuple(wire.FORMATS))
def test_kernel_reference_and_pallas_read_the_table(name):
  """Every format runs in kernels/quantize (the Pallas kernel where the table says so), equal bit
  for bit to the jitted XLA composition."""
  spec = wire.FORMATS[name]
  rng = np.random.default_rng(4)
  g = jnp.asarray(blocks_of_mixed_scale((2, 512), 64, seed=5))
  e = jnp.asarray((1e-3 * rng.standard_normal((2, 512))).astype(np.float32))
  scale = _scale(spec, g + e)

  def composition(g, e):
    x = g + e
    payload, scales = quantize.encode(x, name, 64, scale)
    return payload, scales, x - quantize.decode(payload, scales, name, 64)

  want = jax.jit(composition)(g, e)
  impls = ("xla", "pallas") if spec.pallas else ("xla",)
  for impl in impls:
    run = lambda g, e, impl=impl: ops.quantize_with_feedback(g, e, name, 64, scale, impl=impl,
                                                             interpret=True)
    got = jax.jit(run)(g, e)
    for a, b in zip(got, want):
      assert (a is None) == (b is None), impl
      if b is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, impl
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_a_format_without_pallas_is_refused_by_the_kernel(monkeypatch):
  monkeypatch.setitem(wire.FORMATS, "int8", wire.FORMATS["int8"]._replace(pallas=False))
  with pytest.raises(ValueError, match="int8 has no Pallas kernel"):
    ops.quantize_with_feedback(jnp.zeros((2, 64)), None, "int8", 64, impl="pallas", interpret=True)


@pytest.mark.parametrize("name", tuple(wire.FORMATS))
def test_compression_and_the_planner_read_the_table(name):
  spec = wire.FORMATS[name]
  compress.compressed_sum("replica", 4, name, BLOCK)  # accepted
  assert compress.multiple(name, 4, BLOCK) == 4 * (BLOCK if spec.block_scaled else 2)
  shape = {"fsdp": 1, "tensor": 1, "data": 1, "expert": 1, "replica": 4, "context": 1}
  slow = lambda fmt: estimate.comm_bytes(
      tiny_config(mesh=dict(replica=4), comm=dict(format=fmt, error_feedback="ef")), shape,
      {"params": 1e6})[1]
  assert slow(name) == pytest.approx(slow("f32") * spec.bits / 32, rel=1e-12)


def test_check_names_the_key_and_the_choices_in_one_line():
  wire.check("comm.format", "int8")
  with pytest.raises(config_lib.ConfigError) as e:
    wire.check("comm.format", "int3")
  assert str(e.value) == "comm.format='int3': choose one of f32, bf16, fp8, int8, int4"


@pytest.mark.parametrize("section", ["comm", "diloco"])
def test_optim_build_refuses_an_unknown_format(section):
  cfg = tiny_config(**{section: dict(format="int3")})
  with pytest.raises(config_lib.ConfigError, match=rf"^{section}\.format='int3': choose one of "):
    optim.build(cfg.optim, cfg.train.steps, cfg.comm, cfg.diloco, 4)
