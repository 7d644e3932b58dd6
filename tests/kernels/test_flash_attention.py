"""The Pallas flash attention (interpreted on CPU) against reference.attention, forward and backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.kernels.flash_attention import kernel, ops, reference

# Interpret mode is a scan over the grid: XLA's optimizations only slow its compile, not anything tested.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# Worst absolute error allowed, as a fraction of the largest reference value. float32 sees only reassociation
# (online softmax, blocked sums: measured 4e-7); bfloat16 rounds the output and each tile of probabilities to 8
# bits (measured 4e-3; the reference itself run in bfloat16 is off by 2.5e-3).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _packed_rows(rng, b, n, docs, pad):
  """Segment ids [b, n]: `docs` documents of random lengths, then `pad` padding tokens (segment 0)."""
  segment = np.zeros((b, n), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, n - pad), docs - 1, replace=False))
    segment[row, :n - pad] = 1 + np.searchsorted(cuts, np.arange(n - pad), side="right")
  return segment


def _case(seed, b, l, s, h, g, kd, dtype, docs=3, pad=0, permute=True):
  """Inputs for self-attention (l == s), or for the last l tokens of s attending all s (l < s)."""
  rng = np.random.default_rng(seed)
  k_segment = _packed_rows(rng, b, s, docs, pad)
  k_index = np.tile(np.arange(s, dtype=np.int32), (b, 1))
  if permute:  # context parallelism's order: rows permuted, causality by the original index
    order = np.stack([rng.permutation(s) for _ in range(b)])
    k_segment, k_index = np.take_along_axis(k_segment, order, 1), np.take_along_axis(k_index, order, 1)
  q_segment, q_index = k_segment[:, s - l:], k_index[:, s - l:]
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  arrays = (normal(b, l, h, kd), normal(b, s, g, kd), normal(b, s, g, kd))
  ids = tuple(jnp.asarray(x) for x in (q_segment, k_segment, q_index, k_index))
  return arrays, ids, normal(b, l, h, kd)


def _flash_and_reference(arrays, ids, dout, block_q, block_k):
  """(out, dq, dk, dv) of the kernel, and of the reference in float32 on the same (possibly bf16) inputs."""

  @_jit
  def flash(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: ops.flash_attention(q, k, v, *ids, block_q=block_q, block_k=block_k), q, k, v)
    return (out, *vjp(dout))

  @_jit
  def ref(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, *ids), q, k, v)
    return (out, *vjp(dout))

  f32 = lambda x: x.astype(jnp.float32)
  return flash(*arrays, dout), ref(*map(f32, arrays), f32(dout))


def _assert_close(got, want, dtype):
  for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
    assert x.dtype == dtype, name
    x, y = np.asarray(x, np.float32), np.asarray(y)
    assert np.isfinite(x).all(), name
    err, scale = np.abs(x - y).max(), np.abs(y).max()
    assert err <= TOLERANCE[dtype] * scale, f"{name}: max error {err} vs largest value {scale}"


def test_gqa_packed_padded_permuted_rows_match_reference():
  # Lengths not a multiple of the block; three documents then padding per row, rows permuted.
  arrays, ids, dout = _case(0, 2, 100, 100, 4, 2, 32, jnp.float32, docs=3, pad=13)
  _assert_close(*_flash_and_reference(arrays, ids, dout, 32, 32), jnp.float32)


def test_mqa_bfloat16_causal_rows_match_reference():
  # In row order, so whole tiles are causally masked (and skipped); head dim 24 is padded to 32; unequal blocks.
  arrays, ids, dout = _case(2, 1, 96, 96, 4, 1, 24, jnp.bfloat16, docs=2, permute=False)
  _assert_close(*_flash_and_reference(arrays, ids, dout, 32, 64), jnp.bfloat16)


def test_rows_that_see_no_key_get_zeros_and_finite_gradients():
  # Queries are the last 40 of 150 permuted tokens; those of a segment with no key in the keys see nothing.
  arrays, (q_segment, k_segment, q_index, k_index), dout = _case(1, 2, 40, 150, 2, 1, 16, jnp.float32, docs=4)
  q_segment = q_segment.at[:, :5].set(9)
  got, want = _flash_and_reference(arrays, (q_segment, k_segment, q_index, k_index), dout, 32, 64)
  _assert_close(got, want, jnp.float32)
  assert float(jnp.abs(got[0][:, :5]).max()) == 0.0 and float(jnp.abs(got[1][:, :5]).max()) == 0.0


def test_blocks_must_be_powers_of_two():
  arrays, ids, _ = _case(3, 1, 16, 16, 1, 1, 16, jnp.float32)
  with pytest.raises(ValueError, match="power of two"):
    ops.flash_attention(*arrays, *ids, block_q=48)
  with pytest.raises(ValueError, match="multiple"):
    ops.flash_attention(arrays[0], jnp.zeros((1, 16, 3, 16)), jnp.zeros((1, 16, 3, 16)), *ids)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h, g", [(8, 2), (4, 4), (4, 1)])
def test_larger_sweep_matches_reference(dtype, h, g):
  arrays, ids, dout = _case(4, 2, 300, 300, h, g, 64, dtype, docs=5, pad=37)
  _assert_close(*_flash_and_reference(arrays, ids, dout, 64, 64), dtype)


def test_lowers_to_triton_for_gpu():
  # No GPU here: lowering for CUDA still runs Pallas's Triton lowering of all three kernels (forward, dq, dk/dv).
  q = jax.ShapeDtypeStruct((2, 300, 8, 24), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 24), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)

  def loss(q, k, v, segment, index):
    out = ops.flash_attention(q, k, v, segment, segment, index, index, block_q=64, block_k=32, interpret=False)
    return out.astype(jnp.float32).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  hlo = grad.trace(q, kv, kv, ids, ids).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("custom_call @__gpu$xla.gpu.triton") == 3


@pytest.mark.slow
def test_forward_saves_logsumexp_and_minus_infinity_for_rows_that_see_no_key():
  # The lse a consumer may merge partial results with (context parallelism): log sum exp of the allowed scores.
  arrays, (q_segment, k_segment, q_index, k_index), _ = _case(5, 1, 32, 64, 2, 1, 16, jnp.float32, docs=2)
  q_segment = q_segment.at[:, :3].set(9)
  q, k, v = arrays
  _, lse_BHL = _jit(functools.partial(kernel.forward, scale=0.25, block_q=32, block_k=32, interpret=True))(
      q, k, v, q_segment, k_segment, q_index, k_index)
  scores_BHLS = jnp.einsum("BLHK,BSK->BHLS", q, k[:, :, 0]) * 0.25  # MQA: one kv head
  allowed_BLS = reference.mask(q_segment, k_segment, q_index, k_index)
  want_BHL = jax.nn.logsumexp(jnp.where(allowed_BLS[:, None], scores_BHLS, -jnp.inf), axis=-1)
  assert np.isneginf(np.asarray(lse_BHL[:, :, :3])).all()
  np.testing.assert_allclose(lse_BHL, want_BHL, rtol=1e-5, atol=1e-5)
