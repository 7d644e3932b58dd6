"""Optax gradient transformations: schedules, the AdamW/Muon chain, non-finite skipping, explicit
and compressed gradient reduction (with error feedback), DiLoCo and Streaming DiLoCo.
`build(cfg.optim, steps, cfg.comm, cfg.diloco, shards)` returns one chain and its schedule."""

from jaxtrain.optim.build import Outer, build, decay_mask, outer
from jaxtrain.optim.compress import compressed_mean, compressed_sum
from jaxtrain.optim.diloco import diloco
from jaxtrain.optim.guard import skip_nonfinite
from jaxtrain.optim.reduce import sum_over
from jaxtrain.optim.schedules import make_schedule

__all__ = [
    "Outer", "build", "compressed_mean", "compressed_sum", "decay_mask", "diloco", "make_schedule",
    "outer", "skip_nonfinite", "sum_over"
]
