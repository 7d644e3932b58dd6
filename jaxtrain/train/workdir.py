"""A run's workdir: its config.json (written atomically, read back), and the check at start that
refuses a workdir holding an incompatible run (judged by the config stored in its newest checkpoint,
config.json or not), or with `start_over` clears it. Every process takes the same branch: process
0's view decides, broadcast to the others."""

import json
import os
import shutil

import jax
import numpy as np
from etils import epath

from jaxtrain import checkpoint, config as config_lib


def check_workdir(cfg, workdir: str, start_over: bool) -> None:
  """Refuses a workdir whose checkpoints were made by an incompatible config (one line), or, with
  `start_over`, deletes its checkpoints and logs first."""
  saved_path = os.path.join(workdir, "config.json")
  for name, directory in checkpoint.tier_dirs(cfg.checkpoint, workdir).items():
    if checkpoint.object_store.is_s3(directory):  # endpoint, credentials, bucket: every process
      checkpoint.object_store.check(f"checkpoint tier {name}", directory, cfg.checkpoint)
    elif "://" not in directory and jax.process_index() == 0:
      _probe_directory(f"checkpoint tier {name}", directory)
  if start_over:
    if jax.process_index() == 0:
      if os.path.isfile(saved_path):
        checkpoint.remove_tiers(load_config(workdir).checkpoint, workdir)
      checkpoint.remove_tiers(cfg.checkpoint, workdir)
      for name in ("metrics.jsonl", "tb", "config.json"):
        path = os.path.join(workdir, name)
        if os.path.isdir(path):
          shutil.rmtree(path)
        elif os.path.exists(path):
          os.remove(path)
    _sync("jaxtrain_start_over")
    return
  # The newest checkpoint's own config is the truth (config.json may be missing or stale). Every
  # process takes the same branch (the probe runs Orbax's cross-process barriers): process 0's view
  # decides, and the broadcast is also the barrier that keeps any process from writing config.json
  # before all have looked.
  saved = load_config(workdir) if _agreed(os.path.isfile(saved_path)) else None
  stored = newest_stored_config([cfg] + ([saved] if saved else []), workdir, saved)
  diff = config_lib.incompatible(stored, cfg.to_dict()) if stored is not None else []
  if diff:
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    raise config_lib.ConfigError(
        f"{workdir} holds a run of another config ({shown}); rerun with --start_over "
        "to replace it, or use another --workdir")
  if stored is not None:
    _check_replicas(stored, cfg, workdir)


def _check_replicas(stored: dict, cfg, workdir: str):
  """A run with per-replica optimizer state (DiLoCo's replicas, error-feedback residuals) resumes on
  its number of replicas only: each replica's copy is its own, and neither averaging them nor
  inventing new ones continues the same run. Refused with one line; the mesh may change
  otherwise."""
  saved = config_lib.default_config()
  saved.update_from_flattened_dict({k: v for k, v in config_lib.flat(stored).items()
                                    if k.startswith(("comm.", "diloco.", "mesh."))})
  if not config_lib.per_replica_state(saved):
    return
  axis, n = saved.comm.axis, jax.device_count()
  was, now = config_lib.mesh_shape(saved.mesh, n)[axis], config_lib.mesh_shape(cfg.mesh, n)[axis]
  if was != now:
    raise config_lib.ConfigError(
        f"{workdir} holds a run with {was} shards on the {axis} axis and per-replica "
        f"optimizer state (DiLoCo, error feedback); it resumes on {was} only: set "
        f"--config.mesh.{axis}={was}, or --start_over")


def newest_stored_config(configs, workdir: str, saved=None) -> dict | None:
  """The config stored with the newest step of any tier of `configs` (the step's `meta` item;
  `saved`, the config.json, for a step without one), or None when no tier holds a step."""
  probes = [checkpoint.Checkpoints(c.checkpoint, workdir, read_only=True) for c in configs]
  try:
    found = [p.latest() for p in probes]
    found = [(step, tier) for step, tier in found if step is not None]
    if not found:
      return None
    step, tier = max(found, key=lambda f: f[0])
    if not (epath.Path(tier.directory) / str(step) / "meta").exists():
      return saved.to_dict() if saved else None
    import orbax.checkpoint as ocp
    return tier.manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["config"]
  finally:
    for p in probes:
      p.close()


def _probe_directory(what: str, directory: str) -> None:
  """One ConfigError line unless `directory` exists or can be created; leaves nothing behind."""
  missing, path = [], os.path.abspath(directory)
  while not os.path.exists(path):
    missing.append(path)
    path = os.path.dirname(path)
  try:
    for path in reversed(missing):
      os.mkdir(path)
    if not os.access(directory, os.W_OK):
      raise PermissionError(13, "Permission denied")
  except OSError as e:
    raise config_lib.ConfigError(f"{what} at {directory}: {e.strerror}") from e
  finally:
    for path in missing:
      if os.path.isdir(path):
        os.rmdir(path)


def _agreed(flag: bool) -> bool:
  """Process 0's `flag`, on every process."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _sync(name: str):
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def write_config(cfg, workdir: str):
  """DIR/config.json, replaced atomically (a kill never leaves half a file)."""
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w") as f:
      f.write(cfg.to_json(indent=2))
    os.replace(path + ".tmp", path)


def load_config(workdir: str):
  """The config a workdir was trained with, laid over today's defaults: a key an older version did
  not write reads its default (written once, in config/), one it wrote that is gone is dropped."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise config_lib.ConfigError(f"{path} does not exist; is --workdir a training run?")
  with open(path) as f:
    saved = config_lib.flat(json.load(f))
  cfg = config_lib.default_config()
  known = config_lib.flat(cfg.to_dict())
  cfg.update_from_flattened_dict({k: v for k, v in saved.items() if k in known})
  return cfg
