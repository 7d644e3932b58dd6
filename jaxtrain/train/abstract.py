"""A config's train step as the loop compiles it, on abstract state and batch: nothing is allocated.

What `python -m jaxtrain comm` counts bytes in (train/comm.py) and what the planner is checked against
(plan/compiled.py)."""

import flax.linen as nn
import jax
import numpy as np

from jaxtrain import config as config_lib, parallel
from jaxtrain.train import loop, state as state_lib


def abstract_step(cfg, devices=None):
  """(jitted train step, abstract state, abstract batch, mesh) of a validated `cfg`, allocating nothing.
  Lower it inside `jax.set_mesh(mesh)` and the config's logical axis rules."""
  devices = jax.devices() if devices is None else devices
  mesh, task, tx, schedule = loop.build(cfg, "", devices)
  batch_sh = parallel.batch_sharding(mesh)
  feed = parallel.Feed(task.batch_size, batch_sh)
  try:
    host = next(task.batches("train", feed.lo, feed.hi))  # the shapes and dtypes of one batch
  except (FileNotFoundError, ValueError) as e:  # a text corpus not prepared
    raise config_lib.ConfigError(str(e)) from e
  batch = {k: jax.ShapeDtypeStruct((task.batch_size, *np.shape(v)[1:]), np.asarray(v).dtype, sharding=batch_sh)
           for k, v in host.items()}
  shardings = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       state_lib.abstract_state(task, tx), shardings)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES[cfg.mesh.rules]):
    train_fn, _ = loop.compile_steps(cfg, mesh, task, tx, schedule, shardings)
  return train_fn, state, batch, mesh
