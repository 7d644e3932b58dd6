"""Kernels and scans inside shard_map: with check_vma, every value carries the manual mesh axes it
varies over (`jax.typeof(x).manual_axis_type.varying`, the same spelling in jax 0.10 and 0.11), and
a pallas_call's out_shape or a scan carry must state it. `per_shard` runs a kernel on each shard of
its operands: GSPMD cannot split a custom call (it would gather the operands whole around it), and
Mosaic refuses to be partitioned by it at all."""

import jax
from jax.sharding import PartitionSpec as P

from jaxtrain import collectives


def varying_axes(x) -> frozenset:
  """The manual mesh axes `x` varies over (empty outside shard_map)."""
  kind = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(kind.varying) if kind is not None else frozenset()


def like(shape, dtype, ref) -> jax.ShapeDtypeStruct:
  """A pallas_call output of `shape` and `dtype` that varies over the manual axes `ref` varies
  over."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(ref).manual_axis_type)


def vary_like(x, ref):
  """`x` marked varying over the manual axes `ref` varies over (a kernel's operands must agree;
  the cotangent of an invariant `x` is then summed over those axes)."""
  return collectives.vary(x, tuple(sorted(varying_axes(ref) - varying_axes(x))))


def spec_axes(*specs) -> tuple[str, ...]:
  """The mesh axes `specs` (PartitionSpecs, or None) name, each once, in order."""
  names = []
  for spec in specs:
    for entry in spec or ():
      for a in (entry,) if isinstance(entry, str) else entry or ():
        if a not in names:
          names.append(a)
  return tuple(names)


def per_shard(fn, in_specs, out_specs, check_vma: bool = True):
  """`fn` on each device's shard of its operands, laid out as `in_specs` (outputs as `out_specs`):
  shard_map manual over every mesh axis not manual yet, as Mosaic requires of a kernel (and so
  GSPMD never gathers a custom call's operands whole). `fn` itself on one device. `check_vma`
  off for kernels that do not state how their outputs vary (jax's splash)."""
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(a for a in mesh.axis_names if a not in collectives.manual_axes())
  if mesh.empty or mesh.size == 1 or not names:
    return fn
  if check_vma:
    return collectives.shard_map(fn, names, in_specs, out_specs)
  return jax.shard_map(fn, mesh=mesh, axis_names=set(names), in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)


def tokens_spec(tokens: P | None, ndim: int) -> P:
  """The PartitionSpec of an array [..., D] whose leading axes are the tokens laid out as
  `tokens` (the spec of the [B, L] token grid; None: replicated), flattened to one axis when ndim
  is 2."""
  if tokens is None:
    return P(*[None] * ndim)
  if ndim == 2:
    return P(spec_axes(tokens) or None, None)
  if ndim != len(tokens) + 1:
    raise ValueError(f"tokens {tokens} lay out {len(tokens)} axes, the array has {ndim - 1} "
                     f"before D")
  return P(*tokens, None)
