"""Error feedback + quantization in one pass: `quantize_with_feedback` picks the XLA reference or
the Pallas kernel (interpreted on CPU). Not differentiated: it runs on gradients inside the
optimizer."""

from jax.sharding import PartitionSpec as P

from jaxtrain import wire
from jaxtrain.kernels import manual, platform
from jaxtrain.kernels.quantize import kernel, reference

IMPLEMENTATIONS = ("xla", "pallas")


def quantize_with_feedback(g, error, fmt: str, block: int = 256, scale=None, *, impl: str = "xla",
                           rows_per_program: int = 8, interpret: bool | None = None):
  """(payload, scales, new error) of g + error in `fmt` (wire.FORMATS), as
  reference.quantize_with_feedback (same bits)."""
  if fmt not in wire.FORMATS:
    raise ValueError(f"quantize_with_feedback: unknown format {fmt!r}; choose one of "
                     f"{', '.join(wire.FORMATS)}")
  if impl == "xla":
    return reference.quantize_with_feedback(g, error, fmt, block, scale)
  if impl != "pallas":
    raise ValueError(f"quantize_with_feedback: unknown implementation {impl!r}; choose one of "
                     f"{', '.join(IMPLEMENTATIONS)}")
  spec = wire.FORMATS[fmt]
  if not spec.pallas:
    raise ValueError(f"quantize_with_feedback: format {fmt} has no Pallas kernel; use impl=xla")
  if interpret is None:
    interpret = platform.backend() == "cpu"
  shape = g.shape
  if spec.block_scaled and shape[-1] % block:
    raise ValueError(f"quantize_with_feedback: {fmt} needs a last axis that is a multiple of "
                     f"block={block}, got {shape[-1]}")
  # rows of one block where they fit, else of the last axis
  cols = block if g.size % block == 0 else shape[-1]
  e = None if error is None else error.reshape(-1, cols)
  run = lambda g_RC, e_RC, scale: kernel.quantize_rows(g_RC, e_RC, fmt, scale, rows_per_program,
                                                       interpret)
  if not interpret:  # compiled: on each device's copy (Mosaic wants every mesh axis manual)
    run = manual.per_shard(run, (P(), P(), P()), (P(), P(), P()))
  payload, scales, new_error = run(g.reshape(-1, cols), e, scale)
  payload = payload.reshape(*shape[:-1], spec.payload_size(shape[-1]))
  if spec.block_scaled:
    scales = scales.reshape(*shape[:-1], shape[-1] // block)
  return payload, scales, new_error.reshape(shape)
