"""Pallas kernel of error feedback + quantization: each program reads rows of g and e once and
writes the payload, the scales and the new error (three XLA passes and two float32 temporaries
otherwise). A row is one quantization block for block-scaled formats; the arithmetic is the wire
format's (reference.encode), op for op, so the bits are the same."""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain import wire
from jaxtrain.kernels import compiler, manual, platform
from jaxtrain.kernels.quantize import reference
from jaxtrain.wire import blocks, int4


def _kernel(*refs, fmt: str, has_error: bool, strided: bool):
  spec = wire.FORMATS[fmt]
  refs = list(refs)
  g_ref = refs.pop(0)
  e_ref = refs.pop(0) if has_error else None
  scale_ref = refs.pop(0) if spec.shared_scale is not None else None
  payload_ref = refs.pop(0)
  scales_ref = refs.pop(0) if spec.block_scaled else None
  new_error_ref = refs.pop(0)
  if fmt == "int4":
    int4_body = _int4 if strided else _int4_by_matmul
    return int4_body(g_ref, e_ref, payload_ref, scales_ref, new_error_ref)
  x = g_ref[...].astype(jnp.float32)
  if has_error:
    x = x + e_ref[...]
  scale = None if scale_ref is None else scale_ref[0, 0]
  payload, scales, decoded = reference.encode(x, fmt, scale, rounding=reference.round_half_even,
                                             in_kernel=True)
  payload_ref[...] = payload
  if scales_ref is not None:
    scales_ref[...] = scales[:, None]
  new_error_ref[...] = x - decoded


def _int4(g_ref, e_ref, payload_ref, scales_ref, new_error_ref):
  """wire.int4's arithmetic, op for op, on the even and the odd columns as two strided loads:
  Pallas's Triton lowering cannot slice the [rows, C/2, 2] pairs that int4.pack packs."""
  half = g_ref.shape[1] // 2
  cols = (pl.ds(0, half, stride=2), pl.ds(1, half, stride=2))
  xs = [g_ref[:, c].astype(jnp.float32) for c in cols]
  if e_ref is not None:
    xs = [x + e_ref[:, c] for x, c in zip(xs, cols)]
  absmax = jnp.maximum(jnp.max(jnp.abs(xs[0]), axis=-1), jnp.max(jnp.abs(xs[1]), axis=-1))
  scales = blocks.scales(absmax, int4.QMAX)
  qs = [blocks.levels(x, scales, int4.QMAX, reference.round_half_even) for x in xs]
  payload_ref[...] = int4.join(*qs)
  scales_ref[...] = scales[:, None]
  for c, x, q in zip(cols, xs, qs):
    new_error_ref[:, c] = x - blocks.dequantize(q, scales)


def _int4_by_matmul(g_ref, e_ref, payload_ref, scales_ref, new_error_ref):
  """wire.int4's arithmetic on whole rows, for Mosaic, which cannot lower strided loads: each
  column's level from its row's scale, then byte j = (level 2j + 8) + 16 (level 2j+1 + 8), one
  matmul of the levels with a [C, C/2] matrix of 0, 1 and 16 (exact: small integers)."""
  x = g_ref[...].astype(jnp.float32)
  if e_ref is not None:
    x = x + e_ref[...]
  scales = blocks.scales(jnp.max(jnp.abs(x), axis=-1), int4.QMAX)
  q = blocks.levels(x, scales, int4.QMAX, reference.round_half_even)
  new_error_ref[...] = x - blocks.dequantize(q, scales)
  shape = (x.shape[1], x.shape[1] // 2)
  col, pair = lax.broadcasted_iota(jnp.int32, shape, 0), lax.broadcasted_iota(jnp.int32, shape, 1)
  weights = jnp.where(col == 2 * pair, 1.0, jnp.where(col == 2 * pair + 1, 16.0, 0.0))
  byte = jnp.dot(q.astype(jnp.float32) + 8.0, weights, preferred_element_type=jnp.float32)
  payload_ref[...] = byte.astype(jnp.int32).astype(jnp.uint8)
  scales_ref[...] = scales[:, None]


def quantize_rows(g_RC, e_RC, fmt: str, scale, rows_per_program: int, interpret: bool):
  """g, e [R, C] (e None = no feedback; block-scaled: C is the block) -> (payload [R, C or C/2],
  scales [R] / the shared scale / None, new error [R, C] float32)."""
  spec = wire.FORMATS[fmt]
  r, c = g_RC.shape
  br = min(rows_per_program, r)
  row_spec = lambda cols: pl.BlockSpec((br, cols), lambda i: (i, 0))
  pc = spec.payload_size(c)
  args, in_specs = [g_RC], [row_spec(c)]
  if e_RC is not None:
    args.append(e_RC)
    in_specs.append(row_spec(c))
  if spec.shared_scale is not None:
    args.append(jnp.asarray(scale, jnp.float32).reshape(1, 1))
    in_specs.append(pl.BlockSpec((1, 1), lambda i: (0, 0)))
  out_shape = [manual.like((r, pc), spec.payload, g_RC)]  # inside shard_map: varies as g
  out_specs = [row_spec(pc)]
  if spec.block_scaled:
    out_shape.append(manual.like((r, 1), jnp.float32, g_RC))
    out_specs.append(row_spec(1))
  out_shape.append(manual.like((r, c), jnp.float32, g_RC))
  out_specs.append(row_spec(c))
  outs = pl.pallas_call(
      # Mosaic (TPU) cannot lower int4's strided loads
      functools.partial(_kernel, fmt=fmt, has_error=e_RC is not None,
                        strided=platform.backend() != "tpu"),
      out_shape=tuple(out_shape), grid=(pl.cdiv(r, br),), in_specs=in_specs,
      out_specs=tuple(out_specs), interpret=interpret, name=f"quantize_{fmt}_with_feedback",
      # Triton on NVIDIA GPUs (else jax 0.10 picks Mosaic GPU, which cannot reduce over an axis)
      compiler_params=compiler.params(1, interpret, num_warps=4, num_stages=1),
  )(*args)
  if spec.block_scaled:
    return outs[0], outs[1][:, 0], outs[2]
  return outs[0], (scale if spec.shared_scale is not None else None), outs[1]
