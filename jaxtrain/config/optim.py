"""The `optim` section: the optimizer, its schedule and its guards, defaults and checks. No jax
import here."""

import math

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice, check_floats

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
ON_DIVERGENCE = ("stop", "rollback")
RANGES = {"optim.lr": (0.0, math.inf, False), "optim.b1": (0.0, 1.0, True),
          "optim.b2": (0.0, 1.0, True), "optim.eps": (0.0, math.inf, False),
          "optim.weight_decay": (0.0, math.inf, True), "optim.grad_clip": (0.0, math.inf, True),
          "optim.min_lr_ratio": (0.0, 1.0, True), "optim.decay_fraction": (0.0, 1.0, True)}


def optim_defaults() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.name = "adamw"  # one of OPTIMIZERS
  o.lr = 3e-3
  o.schedule = "cosine"  # one of SCHEDULES
  o.warmup_steps = 50
  o.decay_fraction = 0.2  # wsd: share of steps spent decaying at the end
  o.min_lr_ratio = 0.1
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.grad_clip = 1.0  # global norm; 0 disables
  # an update with a non-finite gradient or value is skipped (counted: skipped_steps)
  o.skip_nonfinite = True
  # that many skipped updates in a row: the run has diverged (see on_divergence)
  o.max_consecutive_skips = 20
  # one of ON_DIVERGENCE: stop (exit status 4), or rollback to the last good checkpoint
  o.on_divergence = "stop"
  o.max_rollbacks = 3  # rollback: give up (stop) after this many
  # Gradient reduction. "" = implicit (GSPMD all-reduces the gradient of the global batch); a mesh
  # axis name = the step computes each shard's gradient over that data axis and the optimizer chain
  # reduces them explicitly (jaxtrain/optim/reduce.py), the seam for compressed reductions.
  o.reduce_axis = ""
  return o


def validate_optim(cfg) -> None:
  o, t = cfg.optim, cfg.train
  check_choice("optim.name", o.name, OPTIMIZERS)
  check_choice("optim.schedule", o.schedule, SCHEDULES)
  check_floats("optim", o, RANGES)
  check_choice("optim.on_divergence", o.on_divergence, ON_DIVERGENCE)
  if o.max_consecutive_skips < 1 or o.max_rollbacks < 0:
    raise ConfigError("optim.max_consecutive_skips must be >= 1 and optim.max_rollbacks >= 0")
  if o.reduce_axis not in ("", "replica", "data"):
    raise ConfigError(f"optim.reduce_axis: unknown value {o.reduce_axis!r}; choose '' (implicit), "
                      "replica or data")
  if o.warmup_steps >= t.steps and t.steps > 1:
    raise ConfigError(
        f"optim.warmup_steps={o.warmup_steps} must be below train.steps={t.steps}: add "
        f"--config.optim.warmup_steps={max(t.steps // 10, 0)}")
