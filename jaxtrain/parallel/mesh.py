"""Mesh construction and the application of the logical-axis rule presets (`config.RULES`).

Model code names logical axes (`jaxtrain.model.axes`); only this package maps them to mesh axes.
"""

import contextlib

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib

MESH_AXES = config_lib.MESH_AXES
DATA_AXES = config_lib.DATA_AXES
RULES = config_lib.RULES


def make_mesh(x, devices=None) -> Mesh:
  """The five-axis mesh of the `mesh` config section `x`, every axis Auto (Linen constraints rely on
  GSPMD)."""
  devices = jax.devices() if devices is None else devices
  shape = config_lib.mesh_shape(x, len(devices))
  sizes = tuple(shape[a] for a in MESH_AXES)
  device_array = np.asarray(devices).reshape(sizes)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def rules(mesh: Mesh, rules_name: str):
  """The preset's rules on `mesh`: without pipeline stages (a size-1 `stage` axis) the stacked
  layers' rule is left out, so no spec names `stage` and every sharding is the one it was before
  stages existed."""
  table = RULES[rules_name]
  if dict(mesh.shape).get("stage", 1) > 1:
    return table
  return [rule for rule in table if rule[1] != "stage"]


def logical_shardings(logical_specs, mesh: Mesh, rules_name: str):
  """Pytree of logical PartitionSpecs (from nn.get_partition_spec) -> NamedShardings."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules(mesh, rules_name))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch arrays of any rank: the leading (batch) axis over every data-like axis."""
  return NamedSharding(mesh, P(DATA_AXES))


def stacked(sharding: NamedSharding) -> NamedSharding:
  """`sharding` behind a new leading axis that no device splits (one entry per step of a call)."""
  return NamedSharding(sharding.mesh, P(None, *sharding.spec))


@contextlib.contextmanager
def activate(mesh: Mesh, rules_name: str):
  """The mesh and the logical-axis rules in context, as every step is traced and compiled."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules(mesh, rules_name)):
    yield
