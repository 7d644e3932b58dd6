"""Pallas kernel of error feedback + quantization: each program reads rows of g and e once and writes the
payload, the scales and the new error (three XLA passes and two float32 temporaries otherwise). A row is one
quantization block for int8/int4; the arithmetic is reference.encode, op for op, so the bits are the same."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.kernels.quantize import reference

PAYLOAD_DTYPE = {"f32": jnp.float32, "bf16": jnp.uint16, "fp8": jnp.uint8, "int8": jnp.uint8, "int4": jnp.uint8}


def _kernel(*refs, fmt: str, has_error: bool):
  refs = list(refs)
  g_ref = refs.pop(0)
  e_ref = refs.pop(0) if has_error else None
  scale_ref = refs.pop(0) if fmt == "fp8" else None
  payload_ref = refs.pop(0)
  scales_ref = refs.pop(0) if fmt in reference.QMAX else None
  new_error_ref = refs.pop(0)
  x = g_ref[...].astype(jnp.float32)
  if has_error:
    x = x + e_ref[...]
  payload, scales, decoded = reference.encode(x, fmt, None if scale_ref is None else scale_ref[0, 0])
  payload_ref[...] = payload
  if scales_ref is not None:
    scales_ref[...] = scales[:, None]
  new_error_ref[...] = x - decoded


def quantize_rows(g_RC, e_RC, fmt: str, scale, rows_per_program: int, interpret: bool):
  """g, e [R, C] (e None = no feedback; int8/int4: C is the block) -> (payload [R, C or C/2], scales [R] or
  None, new error [R, C] float32)."""
  r, c = g_RC.shape
  br = min(rows_per_program, r)
  row_spec = lambda cols: pl.BlockSpec((br, cols), lambda i: (i, 0))
  pc = c // 2 if fmt == "int4" else c
  args, in_specs = [g_RC], [row_spec(c)]
  if e_RC is not None:
    args.append(e_RC)
    in_specs.append(row_spec(c))
  if fmt == "fp8":
    args.append(jnp.asarray(scale, jnp.float32).reshape(1, 1))
    in_specs.append(pl.BlockSpec((1, 1), lambda i: (0, 0)))
  out_shape = [jax.ShapeDtypeStruct((r, pc), PAYLOAD_DTYPE[fmt])]
  out_specs = [row_spec(pc)]
  if fmt in reference.QMAX:
    out_shape.append(jax.ShapeDtypeStruct((r, 1), jnp.float32))
    out_specs.append(row_spec(1))
  out_shape.append(jax.ShapeDtypeStruct((r, c), jnp.float32))
  out_specs.append(row_spec(c))
  outs = pl.pallas_call(
      functools.partial(_kernel, fmt=fmt, has_error=e_RC is not None),
      out_shape=tuple(out_shape), grid=(pl.cdiv(r, br),), in_specs=in_specs, out_specs=tuple(out_specs),
      interpret=interpret, name=f"quantize_{fmt}_with_feedback",
  )(*args)
  if fmt in reference.QMAX:
    return outs[0], outs[1][:, 0], outs[2]
  return outs[0], (scale if fmt == "fp8" else None), outs[1]
