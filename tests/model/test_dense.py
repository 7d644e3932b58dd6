"""The projections' einsum backward (model.projection_vjp): the same gradients as jax's own
transpose of the einsum, auto resolved by the backend the step is traced for, and a model's loss
and gradients the same either way."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, validate
from jaxtrain.kernels import platform
from jaxtrain.model import ModelConfig, Transformer, dense
from tests.fixtures import tiny_config

SPECS = [  # every projection of the model, and an expert's batched one
    ("BLD,DF->BLF", (2, 8, 16), (16, 24)),
    ("BLF,FD->BLD", (2, 8, 24), (24, 16)),
    ("BLD,DHK->BLHK", (2, 8, 16), (16, 4, 8)),
    ("BLHK,HKD->BLD", (2, 8, 4, 8), (4, 8, 16)),
    ("EMD,EDF->EMF", (3, 5, 16), (3, 16, 8)),
]


@pytest.mark.parametrize("spec, x_shape, w_shape", SPECS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_einsum_vjp_equals_jax_transpose(spec, x_shape, w_shape, dtype):
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, x_shape).astype(dtype)
  w = jax.random.normal(kw, w_shape).astype(dtype)

  def run(fn):
    out, vjp = jax.vjp(lambda a, b: fn(spec, a, b), x, w)
    g = jax.random.normal(kg, out.shape).astype(dtype)
    return (out, *vjp(g))

  want = jax.jit(lambda: run(jnp.einsum))()
  got = jax.jit(lambda: run(dense.einsum_vjp))()
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  for g, w_ in zip(got, want):
    assert g.dtype == w_.dtype == dtype
    g, w_ = np.asarray(g, np.float32), np.asarray(w_, np.float32)
    np.testing.assert_allclose(g, w_, atol=tol * np.abs(w_).max(), rtol=0)


def test_auto_is_einsum_on_cpu_only():
  assert dense.resolve("auto", "cpu") == "einsum"
  assert dense.resolve("auto", "gpu") == dense.resolve("auto", "tpu") == "jax"
  with platform.target("tpu"):
    assert dense.resolve("auto") == "jax"
  assert dense.resolve("jax", "cpu") == "jax" and dense.resolve("einsum", "tpu") == "einsum"
  with pytest.raises(ConfigError, match="projection_vjp"):
    validate(tiny_config(model={"projection_vjp": "transpose"}), 8)


def test_model_loss_and_gradients_equal_either_way():
  tokens_BL = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  models = {how: Transformer(ModelConfig.from_config(
      tiny_config(model={"projection_vjp": how, "attention": "xla"}).model))
            for how in ("jax", "einsum")}
  params = nn.unbox(jax.jit(models["jax"].init)(jax.random.key(0), tokens_BL)["params"])

  def loss(model, p):
    logp = jax.nn.log_softmax(model.apply({"params": p}, tokens_BL))
    return -jnp.mean(jnp.take_along_axis(logp, tokens_BL[..., None], -1))

  (want, want_g), (got, got_g) = (jax.jit(jax.value_and_grad(lambda p, m=m: loss(m, p)))(params)
                                  for m in models.values())
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, atol=1e-6 * np.abs(w).max(), rtol=0)
