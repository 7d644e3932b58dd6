"""Meshes, the logical-axis rules applied to them, and batches placed on them."""

from jaxtrain.parallel.feed import Feed
from jaxtrain.parallel.mesh import (DATA_AXES, MESH_AXES, RULES, activate, batch_sharding,
                                    logical_shardings, make_mesh, stacked)

__all__ = [
    "DATA_AXES", "Feed", "MESH_AXES", "RULES", "activate", "batch_sharding", "logical_shardings",
    "make_mesh", "stacked"
]
