"""The dense projections' matmul (attention q/k/v/o, the MLP): `einsum(spec, x, w, cfg)`.

Forward it is jnp.einsum of two operands. Backward, `model.projection_vjp` says how the operand
gradients are formed:
- "jax": jax's own transpose of dot_general. It yields the weight gradient as [out, in] plus a
  transpose, which XLA:CPU turns into a transposed, materialized copy of the output gradient
  (untiled, element by element: 9-11% of small_20m's CPU step for the SwiGLU's alone).
- "einsum": two einsums written out, the weight gradient with the activation first
  ("BLD,BLF->DF") and the input gradient as "BLF,DF->BLD"; the same values to rounding, about
  1.23x small_20m's CPU step on an Intel and 1.16-1.39x on an AMD host (benchmarks/RESULTS.md,
  "jaxtrain vs PyTorch on CPU").
- "auto": "einsum" on CPU, where it was measured and checked (tests/model/test_dense.py); "jax" on
  GPU and TPU, where it has not run.

model.fp8 "current" takes the fp8 dot instead (model/fp8.py), with its own backward."""

import functools

import jax
import jax.numpy as jnp

from jaxtrain.kernels import platform
from jaxtrain.model import fp8

PROJECTION_VJP = ("auto", "jax", "einsum")  # config/model.py mirrors this


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_vjp(spec: str, x, w):
  """jnp.einsum(spec, x, w), its backward written as two einsums (every index of one operand must
  appear in the output or the other operand, as in a projection)."""
  return jnp.einsum(spec, x, w)


def _einsum_fwd(spec, x, w):
  return jnp.einsum(spec, x, w), (x, w)


def _einsum_bwd(spec, residuals, g):
  x, w = residuals
  x_spec, w_spec, out = fp8.operand_specs(spec)
  dx = jnp.einsum(f"{out},{w_spec}->{x_spec}", g, w)
  dw = jnp.einsum(f"{x_spec},{out}->{w_spec}", x, g)
  return dx.astype(x.dtype), dw.astype(w.dtype)


einsum_vjp.defvjp(_einsum_fwd, _einsum_bwd)


def resolve(how: str, backend: str | None = None) -> str:
  """model.projection_vjp resolved for `backend` (the traced-for one by default)."""
  if how == "auto":
    return "einsum" if (backend or platform.backend()) == "cpu" else "jax"
  if how not in PROJECTION_VJP:
    raise ValueError(f"projection_vjp: unknown {how!r}; choose one of {', '.join(PROJECTION_VJP)}")
  return how


def einsum(spec: str, x, w, cfg):
  """A projection x @ w by `spec` ("BLD,DF->BLF"), by cfg.fp8 and cfg.projection_vjp."""
  if cfg.fp8 != "off":
    return fp8.einsum(spec, x, w, cfg.fp8)
  if resolve(cfg.projection_vjp) == "einsum":
    return einsum_vjp(spec, x, w)
  return jnp.einsum(spec, x, w)
