"""Residual add + RMSNorm: the Pallas kernels (interpreted) == the reference, forward and backward, over row
counts that are not multiples of the block; and the decoder with the fused norm == the unfused one.

Tolerances: f32 agrees to float reassociation (the kernel's row means and its dscale sum run in another
order): 1e-5 relative to the largest entry. bf16 outputs are rounded from float32 values that differ in their
last bits, so they agree to one bf16 ulp of the largest entry (2^-7 relative); the sum h is exact in both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from jaxtrain.kernels.rms_norm import ops, reference
from jaxtrain.core.lm import LanguageModel
from tests.fixtures import tiny_config

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2 ** -7}


def _close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("shape,block_rows,dtype", [
    ((37, 24), 8, jnp.float32),  # 37 rows: the last block is partial
    ((2, 9, 40), 4, jnp.bfloat16),  # leading axes flattened, 18 rows
    ((5, 16), 64, jnp.float32),  # one block larger than the rows
    ((64, 32), 16, jnp.bfloat16),  # a multiple of the block
])
def test_kernel_equals_reference(shape, block_rows, dtype):
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], shape).astype(dtype)
  residual = (3 * jax.random.normal(k[1], shape)).astype(dtype)
  scale_D = 1 + 0.2 * jax.random.normal(k[2], shape[-1:])
  g, g_h = jax.random.normal(k[3], shape).astype(dtype), jax.random.normal(k[4], shape).astype(dtype)
  f = lambda x, r, s: ops.add_rms_norm(x, r, s, 1e-6, impl="pallas", block_rows=block_rows, interpret=True)
  out, vjp = jax.vjp(f, x, residual, scale_D)
  want_out, want_vjp = jax.vjp(lambda x, r, s: reference.add_rms_norm(x, r, s, 1e-6), x, residual, scale_D)
  assert np.array_equal(np.asarray(out[1], np.float32), np.asarray(want_out[1], np.float32))  # the sum: exact
  _close(out[0], want_out[0], TOL[dtype])
  for got, want in zip(vjp((g, g_h)), want_vjp((g, g_h))):
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(got, want, TOL[dtype])


@pytest.mark.slow  # ~25 s on 2 cores: the default suite stays under 10 minutes
def test_decoder_with_fused_norm_equals_unfused():
  """Loss and gradients of a tiny model, the block's add + mlp_norm as the Pallas kernel vs separate ops."""
  cfg = tiny_config(model=dict(n_layers=1), train=dict(batch_size=4))
  params = nn.unbox(LanguageModel(cfg, "").init(jax.random.key(0))[0])
  b, l = cfg.train.batch_size, cfg.train.seq_len
  tokens = jax.random.randint(jax.random.key(1), (b, l + 1), 0, cfg.model.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((b, l), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(l), (b, l)), "loss_mask": jnp.ones((b, l), jnp.float32)}
  results = {}
  for impl in ("off", "pallas"):
    cfg.model.fused_norm = impl
    task = LanguageModel(cfg, "")
    results[impl] = jax.jit(jax.value_and_grad(lambda p: task.loss(p, batch, {}, {})[0]))(params)
  (loss, grads), (want_loss, want_grads) = results["pallas"], results["off"]
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    _close(got, want, 1e-5)
