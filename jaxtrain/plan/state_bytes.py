"""Per-device bytes of the train state (params, optimizer state) for any mesh shape, from the
state's logical annotations, without devices: abstract shapes (eval_shape) x the logical rules ->
mesh axes -> each leaf's shard. The same annotations the loop's shardings come from (core/state.py),
so the split is the loop's."""

import json
import math

import flax.linen as nn
import jax
import numpy as np

from jaxtrain import builder, config as config_lib, optim
from jaxtrain.core import state as state_lib


def _shard_bytes(shape, dtype, mesh_axes, mesh_shape: dict) -> int:
  """Bytes of the largest shard of an array of `shape` laid out by `mesh_axes` (a PartitionSpec-like
  tuple)."""
  dims = list(shape)
  for i, entry in enumerate(tuple(mesh_axes)[:len(dims)]):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    ways = math.prod(mesh_shape[a] for a in names)
    dims[i] = -(-dims[i] // ways)
  return int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize


_cache = {}
# model keys that change how the step computes, never the state's shapes (the suggestions try them)
SHAPELESS = ("remat", "attention", "attention_block", "scan_layers", "fused_norm", "fp8")


def state_bytes(cfg, mesh_shape: dict) -> dict:
  """{"params", "opt_state", "other", "n_params"}: per-device bytes of the train state's parts under
  the config's rules (other: step, RNG, non-trainable and task state), and the parameter count.
  Cached: the batch does not change the state, and the batch search asks many times."""
  d = cfg.to_dict()
  d["model"] = {k: v for k, v in d["model"].items() if k not in SHAPELESS}
  d["train"] = {k: d["train"][k] for k in ("seq_len", "task")}
  key = json.dumps([d, mesh_shape], sort_keys=True, default=str)
  if key not in _cache:
    _cache[key] = _state_bytes(cfg, mesh_shape)
  return _cache[key]


def _state_bytes(cfg, mesh_shape: dict) -> dict:
  task = builder.make_task(cfg, "")
  tx, _ = optim.build(cfg.optim, cfg.train.steps, cfg.comm, cfg.diloco, mesh_shape[cfg.comm.axis],
                      cfg.train.seed)
  boxed = jax.eval_shape(state_lib.init_fn(task, tx, boxed=True), 0)
  rules = config_lib.RULES[cfg.mesh.rules]

  def part(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.Partitioned)):
      if isinstance(leaf, nn.Partitioned):
        if not jax.tree.leaves(leaf.value):  # optax.masked's empty node
          continue
        total += _shard_bytes(leaf.value.shape, leaf.value.dtype,
                              nn.logical_to_mesh_axes(leaf.names, rules), mesh_shape)
      elif hasattr(leaf, "shape"):
        total += _shard_bytes(leaf.shape, leaf.dtype, (), mesh_shape)
    return total

  params = part(boxed.params)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(boxed.params)))
  other = part((boxed.step, boxed.rng, boxed.extra, boxed.replica_state, boxed.task_state))
  return {
      "params": params, "opt_state": part(boxed.opt_state), "other": other, "n_params": n_params
  }
