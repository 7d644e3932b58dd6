"""Optax gradient transformations: schedules, the AdamW/Muon chain, non-finite skipping, explicit
gradient reduction. `build(cfg.optim, steps)` returns one chain and its schedule."""

from jaxtrain.optim.build import build, decay_mask
from jaxtrain.optim.guard import skip_nonfinite
from jaxtrain.optim.reduce import sum_over
from jaxtrain.optim.schedules import make_schedule

__all__ = ["build", "decay_mask", "make_schedule", "skip_nonfinite", "sum_over"]
