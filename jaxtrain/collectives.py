"""Collectives with explicit mesh-axis names: the one module that opens `jax.shard_map` and calls
all-to-all, psum, ppermute and friends. The model (MoE dispatch, the pipeline's sends between
stages) and the optimizer (explicit gradient reduction) use these helpers; they never open shard_map
themselves.

Everything here works on the *abstract* mesh of the current context (`jax.set_mesh`), so it runs
the same under jit, inside another shard_map (axes already manual are left alone) and on one device.
"""

import flax.linen as nn
import jax
from jax.sharding import AxisType, PartitionSpec as P


def manual_axes() -> tuple[str, ...]:
  """Mesh axes that are manual here (inside a shard_map over them); () outside any."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def axis_size(name: str) -> int:
  """Size of mesh axis `name` in the current mesh (1 when there is no mesh or no such axis)."""
  return jax.sharding.get_abstract_mesh().shape.get(name, 1)


def mesh_axes(logical: str) -> tuple[str, ...]:
  """Mesh axes that logical axis `logical` maps to under the active rules, leaving out axes of size
  1 and axes already manual: the axes a shard_map over `logical` would make manual."""
  spec = nn.logical_to_mesh_axes((logical,))[0]
  names = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  manual = manual_axes()
  return tuple(a for a in names if axis_size(a) > 1 and a not in manual)


def logical_spec(names) -> P:
  """The PartitionSpec of an array with logical axis `names` under the active rules, with only the
  mesh axes of size > 1 that are not already manual: the in/out spec of a shard_map manual over all
  of them."""
  manual = manual_axes()
  def keep(spec):
    names = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return tuple(a for a in names if axis_size(a) > 1 and a not in manual) or None
  return P(*(keep(s) for s in nn.logical_to_mesh_axes(names)))


def constrain(x, names):
  """`nn.with_logical_constraint`, also inside a shard_map: mesh axes that are manual there are
  dropped from the constraint (they are no longer GSPMD's to place)."""
  manual = manual_axes()
  if not manual:
    return nn.with_logical_constraint(x, names)
  spec = nn.logical_to_mesh_axes(names)
  keep = lambda s: s if s is None else (None if s in manual else s) if isinstance(s, str) else (
      tuple(a for a in s if a not in manual) or None)
  return jax.lax.with_sharding_constraint(x, P(*(keep(s) for s in spec)))


def shard_map(fn, axes: tuple[str, ...], in_specs, out_specs):
  """`fn` manual over mesh `axes` of the current mesh; every other axis stays automatic (GSPMD)."""
  return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), axis_names=set(axes),
                       in_specs=in_specs, out_specs=out_specs)


def all_to_all(x, axis: str, dim: int):
  """Along dimension `dim` of size X (the size of mesh axis `axis`): slice i goes to shard i, and
  what arrives from shard i lands in slice i."""
  return jax.lax.all_to_all(x, axis, dim, dim)


def psum(tree, axes: tuple[str, ...]):
  """Sum over the shards of mesh `axes` (a no-op for no axes)."""
  return jax.lax.psum(tree, axes) if axes else tree


def vary(tree, axes: tuple[str, ...]):
  """Marks a replicated value as varying over manual `axes`, so that its cotangent is summed over
  them where it is cast (in the value's dtype) rather than later."""
  return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree) if axes else tree


def all_gather(x, axis: str):
  """Every shard's `x` concatenated along dimension 0, the same on every shard of `axis`
  (invariant)."""
  try:
    return jax.lax.all_gather(x, axis, tiled=True, to="invarying")  # jax 0.10
  except (TypeError, ValueError):  # a jax whose all_gather has no such `to`
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
      from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis, tiled=True)


def pmax(tree, axes: tuple[str, ...]):
  """Maximum over the shards of mesh `axes` (a no-op for no axes)."""
  return jax.lax.pmax(tree, axes) if axes else tree


def axis_index(axis: str):
  """This shard's index along manual mesh axis `axis` (0 outside any shard_map)."""
  return jax.lax.axis_index(axis) if axis in manual_axes() else 0


def all_gather_along(x, axes: tuple[str, ...], dim: int):
  """Every shard's `x` concatenated along dimension `dim` over mesh `axes`. The result stays
  varying, so its cotangent is reduce-scattered back to the shards (an invariant one would be
  all-reduced, then sliced)."""
  return jax.lax.all_gather(x, axes, axis=dim, tiled=True)


def permute(x, axis: str, pairs: list[tuple[int, int]]):
  """Along manual mesh axis `axis`: shard a's `x` goes to shard b for each (a, b) in `pairs` (a
  shard no pair sends to gets zeros)."""
  return jax.lax.ppermute(x, axis, pairs)


def ppermute(x, axis: str, shift: int = 1):
  """Around the ring of manual mesh axis `axis`: shard i's `x` goes to shard (i + shift) mod n, so
  each shard gets shard (i - shift)'s."""
  n = axis_size(axis)
  return permute(x, axis, [(i, (i + shift) % n) for i in range(n)])
