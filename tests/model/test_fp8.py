"""fp8 matmuls (model.fp8): the custom_vjp against a plain-jnp quantize/dequantize reference (same math,
float32 summation order apart), against the exact float32 matmul within the formats' rounding bound, and a
tiny model that trains with it."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import config as config_lib, metrics
from jaxtrain.model import ModelConfig, Transformer, fp8
from jaxtrain.model.moe import MoeMlp
from tests.fixtures import tiny_config

# (spec, x shape, w shape): the dense, attention-output and expert forms the model uses
SPECS = [("BLD,DF->BLF", (2, 8, 32), (32, 48)), ("BLD,DHK->BLHK", (2, 8, 32), (32, 4, 8)),
         ("BLHK,HKD->BLD", (2, 8, 4, 8), (4, 8, 32)), ("EMD,EDF->EMF", (4, 16, 32), (4, 32, 24))]
# e4m3fn: 3 mantissa bits (relative rounding 2^-4), smallest normal 2^-6, subnormal spacing 2^-9;
# e5m2: 2 mantissa bits (2^-3), smallest normal 2^-14, subnormal spacing 2^-16
FORMATS = {"e4m3": (jnp.float8_e4m3fn, 448.0, 2.0 ** -4, 2.0 ** -10),
           "e5m2": (jnp.float8_e5m2, 57344.0, 2.0 ** -3, 2.0 ** -17)}


def qdq(x, fmt):
  """Reference: x scaled so its amax lands on the format's max, rounded to fp8, scaled back (float32)."""
  dtype, fmax, _, _ = FORMATS[fmt]
  x = np.asarray(x, np.float32)
  scale = np.float32(np.abs(x).max() / fmax)
  q = np.clip(x / scale, -fmax, fmax).astype(dtype)
  return np.asarray(q, np.float32) * scale, scale


def rounding_bound(x, fmt):
  """|qdq(x) - x| <= u |x| (normal range, round to nearest) + half the subnormal spacing x scale."""
  _, _, u, half_sub = FORMATS[fmt]
  return u * np.abs(x) + half_sub * qdq(x, fmt)[1]


def operands(spec_index, seed=0):
  spec, xs, ws = SPECS[spec_index]
  rng = np.random.default_rng(seed)
  x, w = rng.standard_normal(xs).astype(np.float32), (0.05 * rng.standard_normal(ws)).astype(np.float32)
  out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape
  return spec, x, w, rng.standard_normal(out_shape).astype(np.float32)


def run(spec, x, w, g, mode="current"):
  """(out, dx, dw) of fp8.einsum, jitted (eager dispatch of every op is slow)."""
  def f(x, w, g):
    out, vjp = jax.vjp(lambda a, b: fp8.einsum(spec, a, b, mode), x, w)
    return (out,) + vjp(g)
  return jax.jit(f)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))


def transposed(spec):
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  return f"{out},{ws}->{xs}", f"{xs},{out}->{ws}"


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_equals_quantize_dequantize_reference(i):
  """Forward q(x) q(w) with e4m3; gradients q(g) q(w)^T and q(x)^T q(g) with g in e5m2 (the formula)."""
  spec, x, w, g = operands(i)
  out, dx, dw = run(spec, x, w, g)
  (xq, _), (wq, _), (gq, _) = qdq(x, "e4m3"), qdq(w, "e4m3"), qdq(g, "e5m2")
  dx_spec, dw_spec = transposed(spec)
  exact = lambda s, a, b: np.einsum(s, a.astype(np.float64), b.astype(np.float64))
  np.testing.assert_allclose(out, exact(spec, xq, wq), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx, exact(dx_spec, gq, wq), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw, exact(dw_spec, xq, gq), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_error_against_exact_matmul_within_fp8_rounding(i):
  """|a^ b^ - a b| <= |a| e_b + e_a |b| + e_a e_b per product, summed: e the per-element rounding bound of
  the operand's format (rounding_bound); e4m3 for x and w forward, e5m2 for the gradient backward."""
  spec, x, w, g = operands(i, seed=1)
  out, dx, dw = run(spec, x, w, g)
  dx_spec, dw_spec = transposed(spec)
  ex, ew, eg = rounding_bound(x, "e4m3"), rounding_bound(w, "e4m3"), rounding_bound(g, "e5m2")
  for got, s, a, b, ea, eb in ((out, spec, x, w, ex, ew), (dx, dx_spec, g, w, eg, ew), (dw, dw_spec, x, g, ex, eg)):
    err = np.abs(np.asarray(got, np.float64) - np.einsum(s, a.astype(np.float64), b.astype(np.float64)))
    bound = np.einsum(s, np.abs(a), eb) + np.einsum(s, ea, np.abs(b)) + np.einsum(s, ea, eb)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-6), (s, float((err - bound).max()))
    assert err.max() > 1e-4  # the operands really were rounded to fp8


def test_off_is_plain_einsum_and_bad_mode_raises():
  # The same program as jnp.einsum, compared compiled with compiled: XLA:CPU's jitted and op-by-op dots may
  # sum in different orders (they differed by an ulp on an AMD EPYC host, not on a Xeon).
  spec, x, w, g = operands(0)
  def program(einsum):
    def step(x, w, g):
      out, vjp = jax.vjp(lambda a, b: einsum(spec, a, b), x, w)
      return (out,) + vjp(g)
    return jax.jit(step)
  plain, off = program(jnp.einsum), program(lambda *a: fp8.einsum(*a, "off"))
  args = tuple(map(jnp.asarray, (x, w, g)))
  assert off.lower(*args).as_text() == plain.lower(*args).as_text()
  for got, want in zip(off(*args), plain(*args)):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="unknown mode"):
    fp8.einsum(spec, x, w, "delayed")


def test_bfloat16_operands_keep_their_dtypes():
  """bf16 in, bf16 out: the reference on the bf16 values, its result rounded to bf16 (half a bf16 ulp)."""
  spec, x, w, g = (a if isinstance(a, str) else np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
                   for a in operands(0))
  got = run(spec, *(jnp.asarray(a, jnp.bfloat16) for a in (x, w, g)))
  assert all(a.dtype == jnp.bfloat16 for a in got)
  (xq, _), (wq, _), (gq, _) = qdq(x, "e4m3"), qdq(w, "e4m3"), qdq(g, "e5m2")
  dx_spec, dw_spec = transposed(spec)
  for a, want in zip(got, (np.einsum(spec, xq, wq), np.einsum(dx_spec, gq, wq), np.einsum(dw_spec, xq, gq))):
    np.testing.assert_allclose(np.asarray(a, np.float32), want, rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.parametrize("variant", [dict(dispatch="capacity"), dict(grouped_matmul="tiles"),
                                     dict(grouped_matmul="ragged_dot")])
def test_moe_expert_matmuls_in_fp8(variant):
  """Each dispatch path's expert matmuls go through fp8: the output changes, by fp8's rounding only."""
  cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=8, d_ff=24,
                    max_seq_len=16, n_experts=4, top_k=2, init_std=0.5, **variant)
  x = jax.random.normal(jax.random.key(1), (2, 8, 16))
  variables = nn.unbox(jax.jit(MoeMlp(cfg).init)(jax.random.key(0), x))
  off = jax.jit(MoeMlp(cfg).apply)(variables, x)[0]
  on = jax.jit(MoeMlp(dataclasses.replace(cfg, fp8="current")).apply)(variables, x)[0]
  rel = float(jnp.linalg.norm(on - off) / jnp.linalg.norm(off))
  assert 1e-3 < rel < 0.15, rel


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_model_params_unchanged_and_output_close():
  c = tiny_config()
  off, on = (Transformer(ModelConfig.from_config({**c.model.to_dict(), "fp8": m})) for m in ("off", "current"))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  params = jax.jit(off.init)(jax.random.key(0), tokens)
  assert jax.tree.structure(params) == jax.tree.structure(jax.eval_shape(on.init, jax.random.key(0), tokens))
  a, b = jax.jit(off.apply)(params, tokens), jax.jit(on.apply)(params, tokens)
  rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
  assert 1e-4 < rel < 0.1, rel


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_tiny_model_fits_a_batch_in_fp8():
  """Plain SGD on one batch through every fp8 matmul and its custom gradient: finite, falling loss."""
  c = tiny_config(model=dict(fp8="current", compute_dtype="bfloat16", n_layers=1))
  model = Transformer(ModelConfig.from_config(c.model))
  tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)

  def loss_fn(params):
    logits = model.apply(params, tokens[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

  @jax.jit
  def step(params):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))
  losses = []
  for _ in range(8):
    params, loss = step(params)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow  # the whole loop (~4 min on the loaded 2-core machine); the SGD test above covers the math
def test_tiny_model_trains_in_fp8(tmp_path):
  cfg = tiny_config(model=dict(fp8="current", compute_dtype="bfloat16", n_layers=1), train=dict(steps=12))
  jaxtrain.train(cfg, str(tmp_path), progress=False, sync_every_step=True)
  loss = np.array([r["loss"] for r in metrics.read_metrics(str(tmp_path)) if "loss" in r])
  assert len(loss) == 12 and np.all(np.isfinite(loss))
  assert loss[-3:].mean() < loss[:3].mean() - 0.2, loss


def test_bad_value_is_a_config_error():
  cfg = tiny_config(model=dict(fp8="e4m3"))
  with pytest.raises(config_lib.ConfigError, match="model.fp8: unknown value 'e4m3'"):
    config_lib.validate(cfg, 8)
