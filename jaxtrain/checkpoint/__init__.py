"""Checkpoints of any pytree with Orbax. (The checkpointing issue replaces this plain manager.)"""

import os

import flax.serialization
import jax
import orbax.checkpoint as ocp


def manager(workdir: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """An Orbax manager over DIR/checkpoints; saves are asynchronous."""
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state) -> None:
  """Starts an asynchronous save of `state` (any pytree: dataclasses become dicts)."""
  mngr.save(step, args=ocp.args.StandardSave(flax.serialization.to_state_dict(state)))


def restore(mngr: ocp.CheckpointManager, target, shardings, step: int | None = None):
  """Restores into the structure of `target` (arrays or ShapeDtypeStructs) with `shardings`."""
  step = mngr.latest_step() if step is None else step
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, shardings)
  restored = mngr.restore(step, args=ocp.args.StandardRestore(flax.serialization.to_state_dict(abstract)))
  return flax.serialization.from_state_dict(target, restored)
