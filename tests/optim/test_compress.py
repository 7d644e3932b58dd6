"""Compressed reduction over the replica axis of a 4 x 2 mesh: sums within each format's rounding,
error feedback that cancels the bias of quantization over steps, per-replica buffers on their replica."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import collectives, wire
from jaxtrain.optim import compress
from tests.optim.test_quantize import blocks_of_mixed_scale

R = 4  # replicas


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.asarray(jax.devices()).reshape(R, 2), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)


def per_replica(fn, mesh, in_specs, out_specs):
  """`fn` manual over the replica axis, jitted, in `mesh`."""
  def run(*args):
    with jax.set_mesh(mesh):
      return jax.jit(collectives.shard_map(fn, ("replica",), in_specs, out_specs))(*args)
  return run


BOUND = {"f32": 0.0, "bf16": 2.0 ** -8, "fp8": 2.0 ** -4, "int8": 1 / 254, "int4": 1 / 14}


@pytest.mark.parametrize("fmt", tuple(wire.FORMATS))
def test_compressed_mean_of_identical_inputs_is_the_input(mesh, fmt):
  x = blocks_of_mixed_scale((1, 4096), seed=3)[0]
  same = np.tile(x, (R, 1)).reshape(-1)
  total = per_replica(lambda v: compress.reduce_flat(v, "replica", fmt, 256)[0], mesh, P("replica"), P())(same)
  mean = np.asarray(total) / R
  # two roundings (the piece sent, the owner's sum requantized), each within the format's bound of its block
  absmax = np.abs(x.reshape(-1, 256)).max(-1, keepdims=True)
  bound = 2 * BOUND[fmt] * (np.abs(x).reshape(-1, 256) if fmt in ("bf16", "fp8") else absmax)
  if fmt == "fp8":
    bound = bound + 4 * np.abs(x).max() / wire.fp8.FP8_MAX * 2.0 ** -10
  assert np.all(np.abs(mean - x).reshape(-1, 256) <= bound * (1 + 1e-5) + 1e-12)
  if fmt == "f32":
    np.testing.assert_array_equal(mean, x)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8", "int4"])
def test_compressed_sum_of_different_inputs_is_close_to_the_sum(mesh, fmt):
  xs = np.stack([blocks_of_mixed_scale((1, 4096), seed=10 + r)[0] for r in range(R)])
  total = per_replica(lambda v: compress.reduce_flat(v, "replica", fmt, 256)[0], mesh, P("replica"), P())(
      xs.reshape(-1))
  exact = xs.sum(0)
  rel = np.linalg.norm(np.asarray(total) - exact) / np.linalg.norm(exact)
  # Expected: two roundings, each uniform within half a step (rms step/sqrt(12)); int4's step is a seventh
  # of its block's absmax (about 2.8 standard deviations), int8's a 127th: about 0.16 and 0.009 here.
  assert rel < {"bf16": 0.004, "fp8": 0.06, "int8": 0.012, "int4": 0.2}[fmt], rel


def transformation_run(mesh, fmt, feedback, grads, steps):
  """`steps` updates of compressed_sum with the same per-replica gradients `grads` [R, N]: the sum of
  the outputs, and the final state."""
  tx = compress.compressed_sum("replica", R, fmt, 256, feedback)
  params = {"w": jnp.zeros(grads.shape[1:])}
  boxed = tx.init(params)
  specs = jax.tree.map(lambda b: P("replica") if isinstance(b, nn.Partitioned) and b.names[0] == "replica" else P(),
                       boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))
  state = nn.unbox(boxed)

  def body(g, state):
    g = {"w": g[0]}
    total = {"w": jnp.zeros(grads.shape[1:])}
    for _ in range(steps):
      out, state = tx.update(g, state)
      total = jax.tree.map(jnp.add, total, out)
    return total, state

  return per_replica(body, mesh, (P("replica"), specs), (P(), specs))(grads, state)


@pytest.mark.slow  # ~21 s on 2 cores: the default suite stays under 10 minutes
def test_error_feedback_cancels_the_bias_of_int4_over_steps(mesh):
  grads = np.stack([blocks_of_mixed_scale((1, 2048), seed=20 + r)[0] for r in range(R)])
  exact, steps = grads.sum(0), 16
  errors = {}
  for feedback in ("none", "ef", "ef21"):
    total, _ = transformation_run(mesh, "int4", feedback, grads, steps)
    errors[feedback] = np.linalg.norm(np.asarray(total["w"]) / steps - exact) / np.linalg.norm(exact)
  # without feedback the same rounding repeats every step; with it the average converges to the sum
  assert errors["none"] > 0.02
  assert errors["ef"] < errors["none"] / 8 and errors["ef21"] < errors["none"] / 8, errors


def test_feedback_buffers_live_on_their_replica(mesh):
  # each replica's own values, which int8 cannot hold: a constant block (r + 1) / 3 rounds back to
  # itself or not by the last bit of the scale, as XLA orders the division
  draws = [np.random.default_rng(r).standard_normal(1024) for r in range(R)]
  grads = np.stack(draws).astype(np.float32)
  _, state = transformation_run(mesh, "int8", "ef", grads, 1)
  residual = state.residual
  assert residual.shape[0] == R and residual.sharding.spec[0] == "replica"
  assert isinstance(residual.sharding, NamedSharding)
  assert len({d for s in residual.addressable_shards for d in [s.device]}) == 8
  # each replica's residual is its own rounding error, not another's
  assert all(np.abs(np.asarray(residual[r])).max() > 0 for r in range(R))
  assert not np.array_equal(np.asarray(residual[0]), np.asarray(residual[1]))


@pytest.mark.parametrize("fmt,feedback", [("int4", "ef"), ("int8", "ef"), ("fp8", "ef21"), ("bf16", "none")])
def test_pallas_kernel_lowers_inside_the_manual_reduction(mesh, fmt, feedback, monkeypatch):
  """comm.kernel=pallas: the fused quantize kernel inside the step's shard_map (manual over replica, data
  automatic) states how its outputs vary (check_vma) and lowers for CUDA through Triton on this CPU machine.
  (Run on CPU it cannot be: jax's Pallas interpreter fails under check_vma, its TPU interpreter under partial
  automatic sharding, so config.validate refuses it there; the kernel's bits equal the XLA composition in
  tests/kernels/test_quantize_kernel.py.)"""
  grads = np.stack([blocks_of_mixed_scale((1, 1024), seed=40 + r)[0] for r in range(R)])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel compiled, not interpreted
  tx = compress.compressed_sum("replica", R, fmt, 256, feedback, "pallas")
  boxed = tx.init({"w": jnp.zeros(grads.shape[1:])})
  specs = jax.tree.map(lambda b: P("replica") if isinstance(b, nn.Partitioned) and b.names[0] == "replica" else P(),
                       boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))
  body = lambda g, state: tx.update({"w": g[0]}, state)
  g = jax.device_put(grads, NamedSharding(mesh, P("replica")))
  state = jax.tree.map(lambda x, p: jax.device_put(np.asarray(x), NamedSharding(mesh, p)), nn.unbox(boxed), specs)
  with jax.set_mesh(mesh):
    fn = jax.jit(collectives.shard_map(body, ("replica",), (P("replica"), specs), (P(), specs)))
    hlo = fn.trace(g, state).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 2, hlo.count("__gpu$xla.gpu.triton")  # the sender's, the owner's
