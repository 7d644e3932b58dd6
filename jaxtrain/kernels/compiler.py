"""A pallas_call's compiler parameters for the backend it is traced for (`platform.backend()`):
Triton's on GPU (without them jax 0.10 takes the Mosaic GPU route, which cannot lower these
kernels), Mosaic's on TPU (Mosaic refuses Triton's), none when interpreted."""

from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxtrain.kernels import platform


def params(grid_rank: int, interpret: bool, *, num_warps: int = 4, num_stages: int = 2):
  """For a grid of `grid_rank` axes whose programs write disjoint blocks (each axis "parallel":
  TPU megacores split it); `num_warps` and `num_stages` are Triton's."""
  if interpret:
    return None
  if platform.backend() == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
