"""Mesh construction and the logical-axis -> mesh-axis rule presets.

Model code names logical axes (`jaxtrain.model.axes`); only this module knows mesh axes.
"""

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib

MESH_AXES = config_lib.MESH_AXES
# Every data-like axis splits the batch; `fsdp` also splits parameters, `tensor` never the batch.
DATA_AXES = ("replica", "data", "fsdp", "expert")

_BATCH = [("batch", DATA_AXES)]
_FSDP = [("embed", "fsdp")]
_EP = [("expert", "expert")]  # experts over the expert axis; tokens travel to them by all-to-all
_TP = [("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]

# Flax resolves rules in order and skips a mesh axis a dimension already uses, so an activation
# [batch, seq, embed] gets fsdp on batch only, while a [vocab, embed] weight gets it on embed.
RULES = {
    "dp": _BATCH,
    "fsdp": _BATCH + _FSDP,
    "fsdp_tp": _BATCH + _FSDP + _TP,
    "fsdp_ep": _BATCH + _EP + _FSDP,
    "fsdp_tp_ep": _BATCH + _EP + _FSDP + _TP,
}


def make_mesh(cfg, devices=None) -> Mesh:
  """The five-axis mesh of `cfg.mesh`, every axis Auto (Linen constraints rely on GSPMD)."""
  devices = jax.devices() if devices is None else devices
  shape = config_lib.mesh_shape(cfg, len(devices))
  sizes = tuple(shape[a] for a in MESH_AXES)
  device_array = np.asarray(devices).reshape(sizes)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_shardings(logical_specs, mesh: Mesh, rules_name: str):
  """Pytree of logical PartitionSpecs (from nn.get_partition_spec) -> NamedShardings."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, RULES[rules_name])


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[batch, seq] arrays: rows over every data-like axis."""
  return NamedSharding(mesh, P(DATA_AXES, None))
