"""FP8 matmuls with per-tensor current scaling (`model.fp8`): e4m3 operands forward, e5m2 gradients
backward.

Each operand is scaled by amax / fmax of the tensor at hand (current scaling; Micikevicius et al.,
2022, "FP8 Formats for Deep Learning"), clipped to the format's max, cast to fp8, and the dot
accumulates in float32 (`preferred_element_type`) before both scales are multiplied back and the
result is cast to the compute dtype. Backward quantizes the incoming gradient to e5m2 the same way
and forms both operand gradients as fp8 dots of it with the saved e4m3 operands, so the residuals
kept for backward are fp8.

Why not flax.linen.fp8_ops (flax 0.12.8): it implements delayed scaling only, with the scales and
amax histories as variables in an `overwrite_with_gradient` collection whose "gradient" is the new
value; our optimizer chain and train state would have to special-case that collection. Current
scaling needs no state, so it is a small jax.custom_vjp here; delayed scaling (history in the train
state) is not built.

On XLA:CPU an fp8 dot is emulated (fp8 -> f32 converts, then an f32 dot): the numerics are fp8's,
the speed is not. On H100/H200 XLA lowers fp8 x fp8 -> f32 dots to cuBLASLt fp8 GEMMs. Callers:
dense matmuls (attention q/k/v/o, MLP, expert matmuls). Router, embedding, output head and the
attention core (scores, probs x values) stay in the compute dtype or float32.
"""

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MODES = ("off", "current")  # config.FP8 mirrors this


def quantize(x, dtype):
  """(x / scale cast to `dtype`, float32 scale) with scale = amax(|x|) / fmax
  (1 for an all-zero x)."""
  fmax = float(jnp.finfo(dtype).max)
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x))
  scale = jnp.where(amax > 0, amax / fmax, 1.0).astype(jnp.float32)
  return jnp.clip(x / scale, -fmax, fmax).astype(dtype), scale


def operand_specs(spec):
  """(x, w, output) index strings of a two-operand projection einsum; an index of one operand
  that is in neither the output nor the other operand is refused (its gradient is no einsum)."""
  inputs, out = spec.replace(" ", "").split("->")
  x_spec, w_spec = inputs.split(",")
  if (not set(x_spec) <= set(out + w_spec) or not set(w_spec) <= set(out + x_spec)
      or len(set(out)) < len(out)):
    raise ValueError(
        f"einsum {spec!r}: every operand index must appear in the output or the other operand")
  return x_spec, w_spec, out


def _dot(spec, a, b, scale):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum(spec, x, w):
  return _fp8_einsum_fwd(spec, x, w)[0]


def _fp8_einsum_fwd(spec, x, w):
  (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
  out = _dot(spec, xq, wq, sx * sw).astype(jnp.result_type(x, w))
  # zero-size arrays carry the operand dtypes to backward (residuals must be arrays)
  return out, (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_einsum_bwd(spec, res, g):
  xq, sx, wq, sw, x_dtype, w_dtype = res
  x_spec, w_spec, out = operand_specs(spec)
  gq, sg = quantize(g, E5M2)
  dx = _dot(f"{out},{w_spec}->{x_spec}", gq, wq, sg * sw)
  dw = _dot(f"{x_spec},{out}->{w_spec}", xq, gq, sx * sg)
  return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


def einsum(spec, x, w, mode="off"):
  """jnp.einsum(spec, x, w) of two operands; with mode "current" as the fp8 dot above.

  Mode "off" is exactly jnp.einsum (bitwise the same program as before model.fp8 existed)."""
  if mode == "off":
    return jnp.einsum(spec, x, w)
  if mode == "current":
    operand_specs(spec)
    return _fp8_einsum(spec, x, w)
  raise ValueError(f"fp8: unknown mode {mode!r}; choose one of {', '.join(MODES)}")


@jax.custom_vjp
def _qdq_operand(x):
  q, s = quantize(x, E4M3)
  return (q.astype(jnp.float32) * s).astype(x.dtype)


_qdq_operand.defvjp(lambda x: (_qdq_operand(x), None), lambda _, g: (g,))  # straight-through


@jax.custom_vjp
def _qdq_gradient(y):
  return y


def _qdq_gradient_bwd(_, g):
  q, s = quantize(g, E5M2)
  return ((q.astype(jnp.float32) * s).astype(g.dtype),)


_qdq_gradient.defvjp(lambda y: (y, None), _qdq_gradient_bwd)


def ragged_dot(x_MD, w_EDF, sizes_E, mode="off"):
  """jax.lax.ragged_dot; with mode "current" on fp8 quantize-dequantized operands and gradient.

  The values are fp8's (as `einsum`), but the dot runs in the compute dtype: no fp8 grouped GEMM is
  emitted. Only grouped_matmul="ragged_dot" (the TPU default) takes this path."""
  if mode == "off":
    return jax.lax.ragged_dot(x_MD, w_EDF, sizes_E)
  if mode == "current":
    return _qdq_gradient(jax.lax.ragged_dot(_qdq_operand(x_MD), _qdq_operand(w_EDF), sizes_E))
  raise ValueError(f"fp8: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
