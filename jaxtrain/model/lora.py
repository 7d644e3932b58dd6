"""Low-rank adapters (LoRA, Hu et al., 2021): W + alpha / r * A @ B on the weights a pattern names.

A weight's axes are [*batch, *in, *out]: its kind (its last name, WEIGHTS) says how many input and
output axes it has, and any axes before them (the scanned `layers` axis, MoE experts) are batch
axes, one adapter each. Adapters mirror the params' tree, a target leaf becoming
{"a": [*batch, *in, r], "b": [*batch, r, *out]}, boxed with the weight's logical names so that they
shard like it. A starts as PEFT's (uniform over +-1/sqrt(fan in)), B as zeros, so the model starts
exactly as the base. Pure functions over jnp or numpy leaves; no jit here.
"""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

# a weight's kind (its last name) -> (input axes, output axes) after its batch axes
WEIGHTS = {"q": (1, 2), "k": (1, 2), "v": (1, 2), "o": (2, 1), "gate": (1, 1), "up": (1, 1),
           "down": (1, 1), "unembed": (1, 1), "embed": (1, 1)}


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
