"""Pallas kernels of residual add + RMSNorm, forward and backward, over blocks of whole rows (the
norm reduces over D, so a row never spans two programs). Written after jax's
pallas/ops/gpu/rms_norm.py, but with BlockSpecs instead of masked loads, and the scale gradient
reduced per block in the same pass as dx.

Backward, with h the new residual, r = rsqrt(mean(h^2) + eps), n = h r, and cotangents g (normed),
g_h:
  dh = r (g s - n mean(g s n)) + g_h      dscale = sum over rows of g n
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _normalize(h, eps: float):
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)


def _forward_kernel(x_ref, residual_ref, scale_ref, normed_ref, h_ref, *, eps: float):
  h = residual_ref[...] + x_ref[...]
  h_ref[...] = h
  n = _normalize(h.astype(jnp.float32), eps)
  normed_ref[...] = (n * scale_ref[...].astype(jnp.float32)).astype(normed_ref.dtype)


def _backward_kernel(h_ref, scale_ref, g_ref, g_h_ref, dh_ref, dscale_ref, *, eps: float,
                     rows: int):
  br = h_ref.shape[0]
  h = h_ref[...].astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  n = h * r
  g = g_ref[...].astype(jnp.float32)
  gs = g * scale_ref[...].astype(jnp.float32)
  dh = r * (gs - n * jnp.mean(gs * n, axis=-1, keepdims=True)) + g_h_ref[...].astype(jnp.float32)
  dh_ref[...] = dh.astype(dh_ref.dtype)
  row = pl.program_id(0) * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)
  # rows past the end of the last block hold whatever was there: keep them out of the sum
  dscale_ref[...] = jnp.sum(jnp.where(row < rows, g * n, 0.0), axis=0, keepdims=True)


def _row_spec(br: int, d: int):
  return pl.BlockSpec((br, d), lambda i: (i, 0))


def forward(x_ND, residual_ND, scale_D, eps: float, block_rows: int, interpret: bool):
  n, d = x_ND.shape
  br = min(block_rows, n)
  return pl.pallas_call(
      functools.partial(_forward_kernel, eps=eps),
      out_shape=(jax.ShapeDtypeStruct((n, d), x_ND.dtype), jax.ShapeDtypeStruct((n, d),
                                                                                x_ND.dtype)),
      grid=(pl.cdiv(n, br),),
      in_specs=[_row_spec(br, d),
                _row_spec(br, d),
                pl.BlockSpec((1, d), lambda i: (0, 0))],
      out_specs=(_row_spec(br, d), _row_spec(br, d)),
      interpret=interpret,
      name="add_rms_norm_forward",
  )(x_ND, residual_ND, scale_D.reshape(1, d))


def backward(h_ND, scale_D, g_ND, g_h_ND, eps: float, block_rows: int, interpret: bool):
  """(dh [N, D] in h's dtype, dscale [D] float32)."""
  n, d = h_ND.shape
  br = min(block_rows, n)
  blocks = pl.cdiv(n, br)
  dh_ND, dscale_PD = pl.pallas_call(
      functools.partial(_backward_kernel, eps=eps, rows=n),
      out_shape=(jax.ShapeDtypeStruct((n, d),
                                      h_ND.dtype), jax.ShapeDtypeStruct((blocks, d), jnp.float32)),
      grid=(blocks,),
      in_specs=[_row_spec(br, d),
                pl.BlockSpec((1, d), lambda i: (0, 0)),
                _row_spec(br, d),
                _row_spec(br, d)],
      out_specs=(_row_spec(br, d), pl.BlockSpec((1, d), lambda i: (i, 0))),
      interpret=interpret,
      name="add_rms_norm_backward",
  )(h_ND, scale_D.reshape(1, d), g_ND, g_h_ND)
  return dh_ND, jnp.sum(dscale_PD, axis=0)
