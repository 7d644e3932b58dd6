"""The Pallas cross-entropy kernels (interpreted on CPU) against reference.cross_entropy, forward and backward:
token counts, vocabularies and widths that are not multiples of the blocks, both weight layouts, a token mask,
z-loss, float32 and bfloat16; their lowering for CUDA (Triton); and train.cross_entropy=pallas == full in a
tiny language model.

Tolerances: the sums (ce, z) agree to float reassociation in both dtypes (rtol 1e-5; the reference's bf16
products are the kernel's, both accumulated in float32; measured <= 1e-7). float32 gradients agree to 1e-5 of
their largest entry (measured 4e-7). bfloat16 gradients, whose last matmul takes a bf16 cotangent in both and
which are rounded to bf16 last, agree to one bf16 ulp of their largest entry, 2^-7 (measured 3.4e-3): float32
sums that differ in their last bits round to neighbouring bf16 values. The same bounds hold the chunked op.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from jaxtrain import config
from jaxtrain.kernels.cross_entropy import ops
from jaxtrain.core.lm import LanguageModel
from tests.fixtures import tiny_config

# Interpret mode is a scan over the grid: XLA's optimizations only slow its compile, not anything tested.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

GRAD_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2 ** -7}


def _inputs(n, d, v, dtype, w_dtype=None, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x_ND = jax.random.normal(k[0], (n, d)).astype(dtype)
  w_DV = (jax.random.normal(k[1], (d, v)) * 0.5).astype(w_dtype or dtype)
  targets_N = jax.random.randint(k[2], (n,), 0, v)
  mask_N = (jax.random.uniform(k[3], (n,)) > 0.25).astype(jnp.float32)
  return x_ND, w_DV, targets_N, mask_N


@functools.cache  # one compile per configuration, shared by the tests that use it
def _value_and_grads(impl, layout, block_n, block_v, block_d):
  """jitted (x, w, targets, mask) -> ((ce, z, tokens), (dx, dw)) of ce + z / 2 (distinct cotangents)."""

  def f(x_ND, w, targets_N, mask_N):
    ce, z, tokens = ops.cross_entropy(x_ND, w, targets_N, mask_N, 1e-2, w_layout=layout, impl=impl,
                                      block_n=block_n, block_v=block_v, block_d=block_d)
    return ce + 0.5 * z, (ce, z, tokens)

  def sums_and_grads(*args):
    (_, sums), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(*args)
    return sums, grads

  return _jit(sums_and_grads)


@pytest.mark.parametrize("n,d,v,block_n,block_v,block_d,layout,dtype,w_dtype", [
    (37, 24, 101, 16, 32, 16, "DV", jnp.float32, None),  # N, V, D not multiples of the blocks; two D blocks
    (37, 24, 101, 16, 32, 16, "VD", jnp.bfloat16, None),
    (45, 16, 70, 32, 64, 64, "DV", jnp.bfloat16, jnp.float32),  # float32 weights cast to the bf16 compute dtype
    pytest.param(37, 24, 101, 16, 32, 16, "VD", jnp.float32, None, marks=pytest.mark.slow),
    pytest.param(32, 32, 64, 16, 16, 16, "VD", jnp.float32, None, marks=pytest.mark.slow),  # all multiples
])
def test_kernel_equals_reference(n, d, v, block_n, block_v, block_d, layout, dtype, w_dtype):
  x_ND, w_DV, targets_N, mask_N = _inputs(n, d, v, dtype, w_dtype)
  w = w_DV if layout == "DV" else w_DV.T
  got, got_grads = _value_and_grads("pallas", layout, block_n, block_v, block_d)(x_ND, w, targets_N, mask_N)
  want, want_grads = _value_and_grads("full", layout, block_n, block_v, block_d)(x_ND, w, targets_N, mask_N)
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5)
  assert float(got[2]) == float(mask_N.sum()) and float(got[1]) > 0
  for name, g, r in zip(("dx", "dw"), got_grads, want_grads):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    assert np.isfinite(g).all(), name
    np.testing.assert_allclose(g, r, atol=GRAD_TOL[dtype] * np.abs(r).max(), rtol=0, err_msg=name)


def test_masked_tokens_get_no_gradient():
  """A masked token's dx row is exactly zero; with every token masked, so are the sums, dx and dw (padded tokens
  and vocabulary columns add nothing)."""
  x_ND, w_DV, targets_N, mask_N = _inputs(37, 24, 101, jnp.float32, seed=3)
  f = _value_and_grads("pallas", "DV", 16, 32, 16)  # the first case's compile
  _, (dx_ND, _) = f(x_ND, w_DV, targets_N, mask_N)
  masked = np.asarray(mask_N) == 0
  assert masked.any() and float(np.abs(np.asarray(dx_ND)[masked]).max()) == 0.0
  assert float(np.abs(np.asarray(dx_ND)[~masked]).min(axis=1).max()) > 0
  (ce, z, tokens), (dx_ND, dw) = f(x_ND, w_DV, targets_N, 0 * mask_N)
  assert float(ce) == float(z) == float(tokens) == 0.0
  assert float(jnp.abs(dx_ND).max()) == 0.0 and float(jnp.abs(dw).max()) == 0.0


def test_extreme_logits_stay_finite():
  """Online logsumexp: logits of ~1e4 (exp overflows float32) give the reference's finite sums and gradients."""
  x_ND, w_DV, targets_N, mask_N = _inputs(37, 24, 101, jnp.float32, seed=4)
  args = (x_ND * 2e3, w_DV, targets_N, mask_N)
  got, got_grads = _value_and_grads("pallas", "DV", 16, 32, 16)(*args)  # the first case's compiles
  want, want_grads = _value_and_grads("full", "DV", 16, 32, 16)(*args)
  assert np.isfinite(np.array(got)).all() and float(got[0]) > 1e3
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5)
  for g, r in zip(got_grads, want_grads):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * float(np.abs(r).max()), rtol=0)


def test_blocks_must_be_powers_of_two_and_config_knows_pallas():
  x_ND, w_DV, targets_N, mask_N = _inputs(4, 16, 16, jnp.float32)
  with pytest.raises(ValueError, match="power of two"):
    ops.cross_entropy(x_ND, w_DV, targets_N, mask_N, impl="pallas", block_v=48)
  assert config.CROSS_ENTROPY == ops.IMPLEMENTATIONS
  cfg = tiny_config(train=dict(cross_entropy="pallas"))
  config.validate(cfg, 8)
  cfg.train.cross_entropy = "triton"
  with pytest.raises(config.ConfigError, match="train.cross_entropy: unknown value 'triton'"):
    config.validate(cfg, 8)


@pytest.mark.parametrize("layout", ["DV", "VD"])
def test_lowers_to_triton_for_gpu(layout):
  # No GPU here: lowering for CUDA still runs Pallas's Triton lowering of all three kernels (forward, dx, dw),
  # at gpt2_small's width (768 = 12 blocks of 64) with N and V not multiples of the blocks.
  n, d, v = 300, 768, 1000
  x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d, v) if layout == "DV" else (v, d), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32)

  def loss(x, w, targets, mask):
    ce, z, _ = ops.cross_entropy(x, w, targets, mask, 1e-4, w_layout=layout, impl="pallas", interpret=False)
    return ce + z

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  hlo = grad.trace(x, w, *rows).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("custom_call @__gpu$xla.gpu.triton") == 3


@pytest.mark.optimized
def test_head_memory_is_tiles_not_the_logits():
  """gpt2_small's tied head and loss at 8 x 1024 tokens (loss + grad, compiled, not run): the kernels hold no [N, V]
  buffer (1.54 GiB of float32 logits; the unfused head needs 3.21 GiB). Measured on jax 0.10.2 CPU, interpreted:
  0.35 GiB, mostly the float32 dw [V, D] and dx [N, D] the kernels accumulate in."""
  n, d, v = 8 * 1024, 768, 50304
  x, w = jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32)
  f = lambda x, w, t, m: sum(ops.cross_entropy(x, w, t, m, 1e-4, w_layout="VD", impl="pallas")[:2])
  temp = _jit(jax.value_and_grad(f, (0, 1))).lower(x, w, *rows).compile().memory_analysis().temp_size_in_bytes
  assert temp < n * v * 4 / 4, temp / 2 ** 30


def _loss_and_grads(cfg, params, batch):
  task = LanguageModel(cfg, "")
  loss = lambda p: task.loss(p, batch, {}, {})
  (objective, sums), grads = _jit(jax.value_and_grad(loss, has_aux=True))(params)
  return objective, sums, grads


def _random_params(cfg, seed=0):
  """The model's parameter tree filled from numpy (no init compile): norm scales near 1, weights ~ 1/sqrt(fan-in)."""
  rng = np.random.default_rng(seed)
  shapes = nn.unbox(jax.eval_shape(LanguageModel(cfg, "").init, jax.random.key(0))[0])
  fill = lambda s: (1 + 0.1 * rng.normal(size=s.shape) if len(s.shape) == 1 else
                    rng.normal(size=s.shape) / np.sqrt(s.shape[0]))
  return jax.tree.map(lambda s: jnp.asarray(fill(s), s.dtype), shapes)


def test_language_model_pallas_equals_full():
  """A tiny model (tied embeddings, vocab 64, 32 tokens) with z-loss and a loss mask, run with both heads."""
  cfg = tiny_config(model=dict(tie_embeddings=True, n_layers=1), train=dict(z_loss=1e-3, batch_size=2))
  params = _random_params(cfg)
  k = jax.random.split(jax.random.key(1), 2)
  b, l = cfg.train.batch_size, cfg.train.seq_len
  tokens = jax.random.randint(k[0], (b, l + 1), 0, cfg.model.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((b, l), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(l), (b, l)),
           "loss_mask": (jax.random.uniform(k[1], (b, l)) > 0.1).astype(jnp.float32)}
  full = _loss_and_grads(cfg, params, batch)
  cfg.train.update(cross_entropy="pallas")
  fused = _loss_and_grads(cfg, params, batch)
  np.testing.assert_allclose(float(fused[0]), float(full[0]), rtol=1e-6)
  for key in ("ce", "z", "count"):
    np.testing.assert_allclose(float(fused[1][key]), float(full[1][key]), rtol=1e-6)
  assert float(full[1]["z"]) > 0
  flat_full, flat_fused = jax.tree.leaves_with_path(full[2]), jax.tree.leaves(fused[2])
  assert len(flat_full) == len(flat_fused)
  for (path, r), g in zip(flat_full, flat_fused):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * float(np.abs(r).max()), rtol=0,
                               err_msg=jax.tree_util.keystr(path))
