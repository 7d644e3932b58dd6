"""Compressed gradient reduction over one slow mesh axis, with error feedback, as an optax
transformation.

The reduction is ZeRO++'s qgZ: the gradient, one flat float32 vector per shard, is cut into G pieces
(G shards on the axis); each piece is quantized and sent by one all-to-all to the shard that owns
it; the owner sums the G pieces it received in float32, requantizes that sum once, and an
all-gather returns every owner's piece to everyone. Two narrow collectives, one requantization:
never a ring that requantizes at every hop, never a psum of narrow integers (it overflows). The
fast axes of the mesh (the ones not manual here) are reduced by GSPMD in float32 before this runs:
the reduction is hierarchical by construction.

Error feedback keeps what quantization dropped and adds it back next step:
  ef    each shard sends Q(g + e) and keeps e = g + e - Q(g + e) (Seide et al. 2014; Karimireddy
        2019); the owner keeps its requantization residual the same way.
  ef21  each shard keeps an estimate h of its gradient and sends Q(g - h); h += Q(g - h); the
        result is the running sum of the received differences (Richtarik et al. 2021).
Per-shard buffers carry a leading axis of one entry per shard of the axis, laid on that axis: each
lives on its own shard's devices, is checkpointed with the optimizer state, and resumes bitwise.

`kernel` picks who quantizes: "xla" composes optim/quantize.py's encode and decode; "pallas" runs
jaxtrain/kernels/quantize's one-pass kernel (residual added, block scales, payload and new residual
in one read of the vector; interpreted on CPU). Both give the same bits, in any format of
jaxtrain/wire.
"""

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxtrain import collectives, wire
from jaxtrain.kernels.quantize import ops as quantize_ops
from jaxtrain.model import axes
from jaxtrain.optim import quantize

# The logical name of a per-shard leading axis, by the mesh axis it lies on (config.RULES maps them
# back).
PER_SHARD = {"replica": axes.REPLICA, "data": axes.DATA_SHARDS}


class Layout:
  """A pytree <-> one float32 vector [N] (zero-padded to a multiple of `multiple`), layer by layer:
  the slices of every leaf stacked under a "layers" key come first, layer 0's then layer 1's, then
  the other leaves. Contiguous slices of the vector are therefore groups of whole layers (streaming
  DiLoCo's fragments). Exact both ways: flatten then unflatten returns the same bits."""

  def __init__(self, tree, multiple: int = 1):
    with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_paths]
    self.shapes = [tuple(leaf.shape) for leaf in leaves]
    self.dtypes = [leaf.dtype for leaf in leaves]
    layered = [_in_layers(path) and len(shape) > 0
               for (path, _), shape in zip(with_paths, self.shapes)]
    depths = {shape[0] for shape, is_layer in zip(self.shapes, layered) if is_layer}
    self.layered = layered if len(depths) == 1 else [False] * len(leaves)
    self.layers = depths.pop() if len(depths) == 1 else 1
    self.size = sum(math.prod(s) for s in self.shapes)
    self.layer_size = sum(math.prod(s[1:])
                          for s, is_layer in zip(self.shapes, self.layered) if is_layer)
    self.padded = -(-max(self.size, 1) // multiple) * multiple

  def flatten(self, tree):
    leaves = self.treedef.flatten_up_to(tree)
    stacked = [x.reshape(self.layers, -1) for x, is_layer in zip(leaves, self.layered) if is_layer]
    parts = [jnp.concatenate(stacked, axis=1).reshape(-1)] if stacked else []
    parts += [x.reshape(-1) for x, is_layer in zip(leaves, self.layered) if not is_layer]
    parts.append(jnp.zeros([self.padded - self.size], jnp.float32))
    return jnp.concatenate([p.astype(jnp.float32) for p in parts])

  def unflatten(self, flat):
    out, start = [None] * len(self.shapes), 0
    if any(self.layered):
      rows = flat[:self.layers * self.layer_size].reshape(self.layers, self.layer_size)
      start = self.layers * self.layer_size
      col = 0
      for i, (shape, is_layer) in enumerate(zip(self.shapes, self.layered)):
        if is_layer:
          width = math.prod(shape[1:])
          out[i] = rows[:, col:col + width].reshape(shape).astype(self.dtypes[i])
          col += width
    for i, (shape, is_layer) in enumerate(zip(self.shapes, self.layered)):
      if not is_layer:
        n = math.prod(shape)
        out[i] = flat[start:start + n].reshape(shape).astype(self.dtypes[i])
        start += n
    return self.treedef.unflatten(out)


def _in_layers(path) -> bool:
  return any(isinstance(p, jax.tree_util.DictKey) and p.key == "layers" for p in path)


def multiple(fmt: str, shards: int, block: int) -> int:
  """What the flat vector is padded to: G pieces, each of whole blocks (block-scaled) or pairs."""
  return shards * (block if wire.FORMATS[fmt].block_scaled else 2)


KERNELS = quantize_ops.IMPLEMENTATIONS


def _quantize(x, fmt: str, block: int, scale, error, kernel: str):
  """(payload, scales, x + error - what the payload decodes to) of float32 [..., L]; error None =
  zeros."""
  if kernel == "pallas":
    return quantize_ops.quantize_with_feedback(x, error, fmt, block, scale, impl="pallas")
  if error is not None:
    x = x + error
  payload, scales = quantize.encode(x, fmt, block, scale)
  return payload, scales, x - quantize.decode(payload, scales, fmt, block)


def reduce_flat(x, axis: str, fmt: str, block: int, owner_residual=None, kernel: str = "xla"):
  """Sum over the shards of manual mesh `axis` of a flat float32 vector [N] (N a multiple of
  `multiple(fmt, G, block)`), sent in `fmt`: (sum [N], what this shard's pieces arrived as [N],
  what they lost, x - arrived [N], the owner's requantization residual [N/G]). The sum is the same
  on every shard (invariant)."""
  if kernel not in KERNELS:
    raise ValueError(f"reduce_flat: unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
  shards, spec = collectives.axis_size(axis), wire.FORMATS[fmt]
  scale = None
  # one scale agreed by every shard first, so all pieces share it
  if spec.shared_scale is not None:
    scale = spec.shared_scale(collectives.pmax(jnp.max(jnp.abs(x)), (axis,)))
  pieces = x.reshape(shards, -1)
  payload, scales, lost = _quantize(pieces, fmt, block, scale, None, kernel)
  sent = quantize.decode(payload, scales, fmt, block).reshape(-1)
  received = collectives.all_to_all(payload, axis, 0)
  if spec.block_scaled:
    scales = collectives.all_to_all(scales, axis, 0)
  # float32 sum of this shard's piece
  owned = quantize.decode(received, scales, fmt, block).sum(axis=0)
  payload, scales, residual = _quantize(owned, fmt, block,
                                        None if scale is None else scale * shards,
                                        owner_residual, kernel)
  payload = collectives.all_gather(payload, axis)
  if spec.block_scaled:
    scales = collectives.all_gather(scales, axis)
  return quantize.decode(payload, scales, fmt, block), sent, lost.reshape(-1), residual


def per_shard(tree, shards: int, axis: str):
  """Leaves with a leading axis of `shards` entries (zeros here), named to lie on mesh `axis`."""
  name = PER_SHARD[axis]
  def expand(x):
    if isinstance(x, nn.Partitioned):
      if not jax.tree.leaves(x.value):  # optax.masked's empty node: nothing to place
        return x
      return nn.Partitioned(jnp.broadcast_to(x.value, (shards, *x.value.shape)), (name, *x.names),
                            x.mesh)
    return nn.Partitioned(jnp.broadcast_to(x, (shards, *x.shape)), (name,) + (None,) * jnp.ndim(x))
  return jax.tree.map(expand, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def own(tree):
  """This shard's entry of per-shard leaves (the step runs manual over their axis: each sees
  [1, ...])."""
  return jax.tree.map(lambda x: x[0], tree)


def mine(tree):
  """The inverse of `own`: a leaf back with its leading per-shard axis."""
  return jax.tree.map(lambda x: x[None], tree)


class CompressState(NamedTuple):
  # per shard [G, N]: ef's send residual, ef21's estimate of the shard's gradient
  residual: jax.Array | None
  # per shard [G, N/G]: the owner's requantization residual (with feedback)
  owner_residual: jax.Array | None
  estimate: jax.Array | None  # ef21: the running reduced gradient [N] (the same on every shard)
  grad_norm: jax.Array  # global norm of the reduced gradient (the step reports it as `grad_norm`)


def compressed_sum(axis: str, shards: int, fmt: str = "int8", block: int = 256,
                   error_feedback: str = "none",
                   kernel: str = "xla") -> optax.GradientTransformation:
  """Sums each shard's gradient over manual mesh `axis` (of `shards` entries) in format `fmt`
  (wire.FORMATS), with error feedback `none`, `ef` or `ef21`. Runs inside a step that is manual
  over `axis` (optim.reduce_axis's seam: core/step.py); it is the first transformation of the chain.
  Buffers a setting does not use are None (nothing to store); `kernel` (KERNELS) quantizes.
  """
  if (fmt not in wire.FORMATS or error_feedback not in ("none", "ef", "ef21")
      or kernel not in KERNELS):
    raise ValueError(f"compressed_sum: unknown format {fmt!r}, error feedback {error_feedback!r} "
                     f"or kernel {kernel!r}")
  pad = multiple(fmt, shards, block)
  feedback = error_feedback != "none"

  def init(params):
    n = Layout(nn.unbox(params), pad).padded
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    return CompressState(per_shard(zeros(n), shards, axis) if feedback else None,
                         per_shard(zeros(n // shards), shards, axis) if feedback else None,
                         zeros(n) if error_feedback == "ef21" else None, zeros())

  def update(updates, state, params=None):
    del params
    layout = Layout(updates, pad)
    x = layout.flatten(updates)
    residual = own(state.residual) if feedback else None
    if error_feedback == "ef":
      x = x + residual
    elif error_feedback == "ef21":
      x = x - residual
    total, sent, lost, owner_residual = reduce_flat(
        x, axis, fmt, block, own(state.owner_residual) if feedback else None, kernel)
    estimate = state.estimate
    if error_feedback == "ef":
      residual = lost
    elif error_feedback == "ef21":
      residual = residual + sent
      estimate = estimate + total
      total = estimate
    reduced = layout.unflatten(total)
    if not feedback:
      return reduced, state._replace(grad_norm=optax.tree.norm(reduced))
    return reduced, CompressState(mine(residual), mine(owner_residual), estimate,
                                  optax.tree.norm(reduced))

  return optax.GradientTransformation(init, update)


def compressed_mean(axis: str, shards: int, fmt: str = "int8", block: int = 256,
                    error_feedback: str = "none",
                    kernel: str = "xla") -> optax.GradientTransformation:
  """compressed_sum divided by the number of shards: the mean of the shards' gradients."""
  return optax.chain(compressed_sum(axis, shards, fmt, block, error_feedback, kernel),
                     optax.scale(1.0 / shards))
