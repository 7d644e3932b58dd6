"""Low-rank adapters (LoRA, Hu et al., 2021): W + alpha / r * A @ B on the weights a pattern names.

A weight's axes are [*batch, *in, *out]: its kind (its last name, WEIGHTS) says how many input and
output axes it has, and any axes before them (the scanned `layers` axis, MoE experts) are batch
axes, one adapter each. Adapters mirror the params' tree, a target leaf becoming
{"a": [*batch, *in, r], "b": [*batch, r, *out]}, boxed with the weight's logical names so that they
shard like it. A starts as PEFT's (uniform over +-1/sqrt(fan in)), B as zeros, so the model starts
exactly as the base. Pure functions over jnp or numpy leaves; no jit here.

A frozen base may be held in int8 (QLoRA-style, model.lora_base_bits=8; Dettmers et al., 2023 use
4-bit NF4): each layer weight (QUANTIZED kinds) as `Int8`, round(w / s) with s its absmax over the
input axes / 127 (one float32 scale per output channel, per batch index), dequantized where the
step merges. The embedding, the output projection and the norms stay as they are.
"""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

# a weight's kind (its last name) -> (input axes, output axes) after its batch axes
WEIGHTS = {"q": (1, 2), "k": (1, 2), "v": (1, 2), "o": (2, 1), "gate": (1, 1), "up": (1, 1),
           "down": (1, 1), "unembed": (1, 1), "embed": (1, 1)}


QUANTIZED = ("q", "k", "v", "o", "gate", "up", "down")  # the layer weights an int8 base holds in int8


@jax.tree_util.register_pytree_node_class
class Int8:
  """A frozen weight as int8 `q` and a float32 `scale` (its shape but 1 on the reduced `axes`);
  `dtype` the weight's own, which dequantize gives back."""

  def __init__(self, q, scale, dtype: str, axes: tuple):
    self.q, self.scale, self.dtype, self.axes = q, scale, dtype, axes

  def tree_flatten(self):
    return (self.q, self.scale), (self.dtype, self.axes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)


def _is_int8(x) -> bool:
  return isinstance(x, Int8)


def quantize_weight(w, axes: tuple, dtype: str | None = None) -> Int8:
  """w as Int8, one absmax scale per index of the axes not in `axes` (an all-zero slice: scale 1)."""
  w32 = jnp.asarray(w, jnp.float32)
  scale = jnp.max(jnp.abs(w32), axis=axes, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return Int8(q, scale, dtype or jnp.dtype(w.dtype).name, tuple(axes))


def quantize(base):
  """The base with each QUANTIZED weight as Int8 (boxed leaves: q keeps the weight's logical
  names, the scale drops those of the reduced input axes)."""
  def leaf(path, x):
    name = path_name(path)
    if name.split("/")[-1] not in QUANTIZED:
      return x
    value = x.unbox(apply_constraint=False) if _is_box(x) else x
    nb, n_in, _ = split(name, value.ndim)
    w = quantize_weight(value, tuple(range(nb, nb + n_in)))
    if not _is_box(x):
      return w
    names = tuple(None if nb <= i < nb + n_in else a for i, a in enumerate(x.names))
    return Int8(x.replace(value=w.q), x.replace(value=w.scale, names=names), w.dtype, w.axes)
  return jax.tree_util.tree_map_with_path(leaf, base, is_leaf=_is_box)


def dequantize(tree):
  """The float weights of a base (Int8 leaves as q * scale in their own dtype; others as they are)."""
  return jax.tree.map(
      lambda x: (x.q.astype(jnp.float32) * x.scale).astype(x.dtype) if _is_int8(x) else x, tree,
      is_leaf=_is_int8)


def float_like(tree, shardings):
  """ShapeDtypeStructs, placed as `shardings` says, of the float weights a (possibly quantized)
  base stands for: what loading it from its source reads."""
  def like(x, s):
    if _is_int8(x):
      return jax.ShapeDtypeStruct(x.q.shape, jnp.dtype(x.dtype), sharding=s.q)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.map(like, tree, shardings, is_leaf=_is_int8)


def requantize(tree, loaded, shardings):
  """`loaded` (the float weights of float_like(tree, ...)) quantized where `tree` holds Int8, each
  part placed as `shardings` says; `loaded` itself when nothing is quantized."""
  def leaf(x, w, s):
    if not _is_int8(x):
      return w
    new = quantize_weight(w, x.axes, x.dtype)
    return Int8(jax.device_put(new.q, s.q), jax.device_put(new.scale, s.scale), x.dtype, x.axes)
  return jax.tree.map(leaf, tree, loaded, shardings, is_leaf=_is_int8)


def path_name(path) -> str:
  """A leaf's '/'-joined dict keys ("layers/attn/q"); a logical-axis box adds none."""
  return "/".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


def targets(params, pattern: str) -> list[str]:
  """The paths of the weights that `pattern` (a regex, full match) names, in tree order; only
  weights of a known kind (WEIGHTS) are targets."""
  regex = re.compile(pattern)
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
  names = [path_name(p) for p, _ in leaves]
  return [n for n in names if n.split("/")[-1] in WEIGHTS and regex.fullmatch(n)]


def split(name: str, ndim: int) -> tuple[int, int, int]:
  """(batch, in, out) axis counts of the weight at `name` with `ndim` axes."""
  n_in, n_out = WEIGHTS[name.split("/")[-1]]
  return ndim - n_in - n_out, n_in, n_out


def init(rng, params, names: list[str], rank: int, dtype=jnp.float32) -> dict:
  """Adapters of the weights at `names` in `params` (boxed or not; boxes give the adapters the
  weights' logical names): A uniform in +-1/sqrt(fan in), B zero."""
  leaves = dict((path_name(p), x) for p, x in
                jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0])
  adapters = {}
  for i, name in enumerate(names):
    leaf = leaves[name]
    value = leaf.unbox(apply_constraint=False) if _is_box(leaf) else leaf
    nb, n_in, _ = split(name, value.ndim)
    batch, fan_in, out = value.shape[:nb], value.shape[nb:nb + n_in], value.shape[nb + n_in:]
    bound = 1.0 / math.sqrt(math.prod(fan_in))
    a = jax.random.uniform(jax.random.fold_in(rng, i), (*batch, *fan_in, rank), dtype, -bound,
                           bound)
    b = jnp.zeros((*batch, rank, *out), dtype)
    if _is_box(leaf):
      axes = leaf.names
      a = leaf.replace(value=a, names=(*axes[:nb + n_in], None))
      b = leaf.replace(value=b, names=(*axes[:nb], None, *axes[nb + n_in:]))
    _put(adapters, name, {"a": a, "b": b})
  return adapters


def _put(tree: dict, name: str, value) -> None:
  *parents, last = name.split("/")
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[last] = value


def delta(a, b, scale: float, shape, dtype):
  """scale * A @ B as a weight of `shape` and `dtype`, computed in float32."""
  nb = a.ndim + b.ndim - 2 - len(shape)  # the batch axes (a and b both have them, and r)
  batch, rank = a.shape[:nb], a.shape[-1]
  a_bIr = a.astype(jnp.float32).reshape(*batch, -1, rank)
  b_brO = b.astype(jnp.float32).reshape(*batch, rank, -1)
  return (scale * jnp.matmul(a_bIr, b_brO)).reshape(shape).astype(dtype)


def merge(base, adapters: dict, alpha: float, rank: int):
  """The full weights: base + alpha / rank * A @ B at each adapted leaf, in the base's dtype (the
  sum in float32); every other leaf is the base's own."""
  scale = alpha / rank

  def leaf(path, w):
    node = adapters
    for key in path_name(path).split("/"):
      if not isinstance(node, dict) or key not in node:
        return w
      node = node[key]
    d = delta(node["a"], node["b"], scale, w.shape, jnp.float32)
    return (w.astype(jnp.float32) + d).astype(w.dtype)
  return jax.tree_util.tree_map_with_path(leaf, base)
