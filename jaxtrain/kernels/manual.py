"""Kernels and scans inside shard_map: with check_vma, every value carries the manual mesh axes it
varies over (`jax.typeof(x).manual_axis_type.varying`, the same spelling in jax 0.10 and 0.11), and
a pallas_call's out_shape or a scan carry must state it."""

import jax


def varying_axes(x) -> frozenset:
  """The manual mesh axes `x` varies over (empty outside shard_map)."""
  kind = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(kind.varying) if kind is not None else frozenset()


def like(shape, dtype, ref) -> jax.ShapeDtypeStruct:
  """A pallas_call output of `shape` and `dtype` that varies over the manual axes `ref` varies
  over."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(ref).manual_axis_type)
