"""Pallas kernels of residual add + RMSNorm, forward and backward, over blocks of whole rows (the
norm reduces over D, so a row never spans two programs). Written after jax's
pallas/ops/gpu/rms_norm.py, but with BlockSpecs, and the scale gradient reduced per block in the
same pass as dx.

Backward, with h the new residual, r = rsqrt(mean(h^2) + eps), n = h r, and cotangents g (normed),
g_h:
  dh = r (g s - n mean(g s n)) + g_h      dscale = sum over rows of g n

Routes: interpreted on CPU; Mosaic on TPU, which pads a partial last block; Triton on GPU, whose
tiles are powers of two: blocks are (rows, next power of two of D), and every load and store is
masked to the rows and columns of the array.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxtrain.kernels import compiler, manual, platform

# A block's working set on the target: Mosaic keeps every (rows, D) buffer in VMEM, double-buffered
# (5 of them in the backward, with float32 temporaries; v5e scopes 16 MiB); Triton keeps the
# tile in registers (a (256, 4096) tile spills for minutes in ptxas).
TPU_BLOCK_BYTES = 512 * 1024
GPU_BLOCK_ELEMENTS = 8192


def _masks(shape, rows: int, d: int, masked: bool):
  """Where a (rows, columns) block and the (1, columns) scale row lie inside the array: Triton's
  route reads and writes nothing else (None, None on the others)."""
  if not masked:
    return None, None
  row = pl.program_id(0) * shape[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return (row < rows) & (col < d), jax.lax.broadcasted_iota(jnp.int32, (1, shape[1]), 1) < d


def _load(ref, mask):
  return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)


def _store(ref, value, mask):
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def _mean(x, d: int):
  """The mean over the D real columns (a padded block's extra columns are 0)."""
  return jnp.sum(x, axis=-1, keepdims=True) / d


def _forward_kernel(x_ref, residual_ref, scale_ref, normed_ref, h_ref, *, eps: float, rows: int,
                    d: int, masked: bool):
  block, scale_row = _masks(x_ref.shape, rows, d, masked)
  h = _load(residual_ref, block) + _load(x_ref, block)
  _store(h_ref, h, block)
  h = h.astype(jnp.float32)
  n = h * jax.lax.rsqrt(_mean(h * h, d) + eps)
  normed = n * _load(scale_ref, scale_row).astype(jnp.float32)
  _store(normed_ref, normed.astype(normed_ref.dtype), block)


def _backward_kernel(h_ref, scale_ref, g_ref, g_h_ref, dh_ref, dscale_ref, *, eps: float,
                     rows: int, d: int, masked: bool):
  block, scale_row = _masks(h_ref.shape, rows, d, masked)
  br = h_ref.shape[0]
  h = _load(h_ref, block).astype(jnp.float32)
  r = jax.lax.rsqrt(_mean(h * h, d) + eps)
  n = h * r
  g = _load(g_ref, block).astype(jnp.float32)
  gs = g * _load(scale_ref, scale_row).astype(jnp.float32)
  dh = r * (gs - n * _mean(gs * n, d)) + _load(g_h_ref, block).astype(jnp.float32)
  _store(dh_ref, dh.astype(dh_ref.dtype), block)
  row = pl.program_id(0) * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)
  # rows past the end of the last block hold whatever was there: keep them out of the sum
  dscale = jnp.sum(jnp.where(row < rows, g * n, 0.0), axis=0, keepdims=True)
  _store(dscale_ref, dscale, scale_row)


def triton(interpret: bool) -> bool:
  """Whether the kernels take Triton's route (compiled, not for TPU)."""
  return not interpret and platform.backend() != "tpu"


def blocks(n: int, d: int, itemsize: int, block_rows: int, interpret: bool) -> tuple[int, int]:
  """(rows, columns) of a program's block: at most `block_rows` rows, fewer where the block would
  not fit the target (TPU_BLOCK_BYTES a buffer on TPU, in multiples of 16 rows; GPU_BLOCK_ELEMENTS
  a tile on GPU, both sides powers of two)."""
  if interpret:
    return min(block_rows, n), d
  if not triton(interpret):
    return min(block_rows, max(16, TPU_BLOCK_BYTES // (d * itemsize) // 16 * 16), n), d
  cols = pl.next_power_of_2(d)
  return pl.next_power_of_2(min(block_rows, max(1, GPU_BLOCK_ELEMENTS // cols), n)), cols


def _call(kernel, grid, in_specs, out_specs, out_shape, bc: int, interpret: bool, name: str):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=compiler.params(1, interpret, num_warps=4 if bc <= 2048 else 8),
      interpret=interpret, name=name)


def forward(x_ND, residual_ND, scale_D, eps: float, block_rows: int, interpret: bool):
  n, d = x_ND.shape
  br, bd = blocks(n, d, x_ND.dtype.itemsize, block_rows, interpret)
  row_spec = pl.BlockSpec((br, bd), lambda i: (i, 0))
  return _call(
      functools.partial(_forward_kernel, eps=eps, rows=n, d=d, masked=triton(interpret)),
      (pl.cdiv(n, br),),
      [row_spec, row_spec, pl.BlockSpec((1, bd), lambda i: (0, 0))],
      (row_spec, row_spec),
      (manual.like((n, d), x_ND.dtype, x_ND), manual.like((n, d), x_ND.dtype, x_ND)),
      br * bd, interpret, "add_rms_norm_forward",
  )(x_ND, residual_ND, scale_D.reshape(1, d))


def backward(h_ND, scale_D, g_ND, g_h_ND, eps: float, block_rows: int, interpret: bool):
  """(dh [N, D] in h's dtype, dscale [D] float32)."""
  n, d = h_ND.shape
  br, bd = blocks(n, d, h_ND.dtype.itemsize, block_rows, interpret)
  row_spec = pl.BlockSpec((br, bd), lambda i: (i, 0))
  grid = pl.cdiv(n, br)
  dh_ND, dscale_P1D = _call(
      functools.partial(_backward_kernel, eps=eps, rows=n, d=d, masked=triton(interpret)),
      (grid,),
      [row_spec, pl.BlockSpec((1, bd), lambda i: (0, 0)), row_spec, row_spec],
      # dscale per block as [blocks, 1, D]: a (1, D) block is the whole of its last two axes (TPU)
      (row_spec, pl.BlockSpec((None, 1, bd), lambda i: (i, 0, 0))),
      (manual.like((n, d), h_ND.dtype, h_ND), manual.like((grid, 1, d), jnp.float32, h_ND)),
      br * bd, interpret, "add_rms_norm_backward",
  )(h_ND, scale_D.reshape(1, d), g_ND, g_h_ND)
  return dh_ND, jnp.sum(dscale_P1D, axis=(0, 1))
