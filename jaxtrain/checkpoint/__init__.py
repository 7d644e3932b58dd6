"""Checkpoints of any pytree with Orbax. (The checkpointing issue replaces this plain manager.)"""

import json
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


def save_data_state(workdir: str, step: int, process_index: int, state: dict) -> None:
  """The data iterator's state at `step`, one small JSON file per process, written atomically
  before the train state's save starts (so a complete checkpoint always has its data state)."""
  path = _data_state_path(workdir, step, process_index)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(state, f)
  os.replace(path + ".tmp", path)


def load_data_state(workdir: str, step: int, process_index: int) -> dict:
  with open(_data_state_path(workdir, step, process_index)) as f:
    return json.load(f)


def prune_data_states(workdir: str, keep_steps) -> None:
  """Deletes data states of steps the checkpoint manager no longer keeps."""
  root = os.path.join(workdir, "data_state")
  keep = {str(s) for s in keep_steps}
  for name in os.listdir(root) if os.path.isdir(root) else []:
    if name not in keep:
      for f in os.listdir(os.path.join(root, name)):
        os.remove(os.path.join(root, name, f))
      os.rmdir(os.path.join(root, name))


def _data_state_path(workdir, step, process_index):
  return os.path.join(workdir, "data_state", str(step), f"process_{process_index}.json")
