"""Residual add + RMSNorm: `add_rms_norm` picks the XLA reference (differentiated by jax) or the
Pallas kernels (custom_vjp; interpreted on CPU; compiled, run per shard of the tokens)."""

import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxtrain.kernels.rms_norm import kernel, reference
from jaxtrain.kernels import manual, platform

IMPLEMENTATIONS = ("xla", "pallas")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pallas(x_ND, residual_ND, scale_D, eps, block_rows, interpret):
  return kernel.forward(x_ND, residual_ND, scale_D, eps, block_rows, interpret)


def _pallas_fwd(x_ND, residual_ND, scale_D, eps, block_rows, interpret):
  normed_ND, h_ND = kernel.forward(x_ND, residual_ND, scale_D, eps, block_rows, interpret)
  return (normed_ND, h_ND), (h_ND, scale_D)


def _pallas_bwd(eps, block_rows, interpret, res, g):
  h_ND, scale_D = res
  g_ND, g_h_ND = g
  dh_ND, dscale_D = kernel.backward(h_ND, scale_D, g_ND, g_h_ND, eps, block_rows, interpret)
  return dh_ND, dh_ND, dscale_D.astype(scale_D.dtype)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def add_rms_norm(x, residual, scale_D, eps: float, *, impl: str = "xla", block_rows: int = 256,
                 interpret: bool | None = None, tokens: P | None = None):
  """(normed, residual + x) for x and residual [..., D] of one dtype; `interpret` defaults to True
  on CPU. `tokens`: how the leading axes lie on the mesh (collectives.logical_spec of them); the
  compiled kernels run on each shard of them (block_rows shrinks to what the target holds)."""
  if impl == "xla":
    return reference.add_rms_norm(x, residual, scale_D, eps)
  if impl != "pallas":
    raise ValueError(f"add_rms_norm: unknown implementation {impl!r}; "
                     f"choose one of {', '.join(IMPLEMENTATIONS)}")
  if x.dtype != residual.dtype or x.shape != residual.shape:
    raise ValueError(f"add_rms_norm: x {x.shape} {x.dtype} and residual {residual.shape} "
                     f"{residual.dtype} differ")
  if interpret is None:
    interpret = platform.backend() == "cpu"

  def run(x, residual, scale_D):
    d = x.shape[-1]
    normed, h = _pallas(x.reshape(-1, d), residual.reshape(-1, d), manual.vary_like(scale_D, x),
                        float(eps),
                        int(block_rows), bool(interpret))
    return normed.reshape(x.shape), h.reshape(x.shape)

  if interpret:  # Pallas's interpreter cannot run under shard_map (kernels/manual.py)
    return run(x, residual, scale_D)
  spec = manual.tokens_spec(tokens, x.ndim)
  return manual.per_shard(run, (spec, spec, P()), (spec, spec))(x, residual, scale_D)
