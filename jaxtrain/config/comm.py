"""The `comm` and `diloco` sections: communication-efficient training over one slow mesh axis
(jaxtrain/optim/compress.py, diloco.py), and their checks. No jax import here."""

import math

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice, check_floats
from jaxtrain.config.mesh import DATA_AXES

ERROR_FEEDBACK = ("none", "ef", "ef21")
COMM_KERNELS = ("xla", "pallas")  # jaxtrain/optim/compress.py KERNELS
RANGES = {"diloco.outer_lr": (0.0, math.inf, False), "diloco.outer_momentum": (0.0, 1.0, True),
          "diloco.mix": (0.0, 1.0, True), "diloco.drop_prob": (0.0, 1.0, True)}


def comm_defaults() -> ml_collections.ConfigDict:
  cm = ml_collections.ConfigDict()
  # the slow axis whose gradient reduction is compressed (fast axes stay float32)
  cm.axis = "replica"
  # a wire format (jaxtrain/wire); f32 with error_feedback=none is plain data parallelism
  cm.format = "f32"
  cm.block = 256  # int8/int4 (and diloco.format): elements per absmax scale; even
  cm.error_feedback = "none"  # one of ERROR_FEEDBACK: none, ef (residual into the next step), ef21
  # one of COMM_KERNELS: who quantizes (pallas: one fused pass, jaxtrain/kernels/quantize; same
  # bits)
  cm.kernel = "xla"
  return cm


def diloco_defaults() -> ml_collections.ConfigDict:
  dl = ml_collections.ConfigDict()
  # H: inner steps per replica between syncs over comm.axis; 0 = off (data parallel)
  dl.inner_steps = 0
  dl.outer_lr = 0.7
  dl.outer_momentum = 0.9  # Nesterov
  dl.format = "f32"  # a wire format (jaxtrain/wire): the outer gradients' format on the wire
  dl.fragments = 1  # P: streaming DiLoCo syncs 1/P of the parameters every H/P steps, staggered
  dl.delay = 0  # tau: a fragment's average is applied tau inner steps after it was sent (overlap)
  dl.mix = 0.5  # with delay: local = mix * local + (1 - mix) * new global for the fragment
  dl.drop_prob = 0.0  # simulation: each replica misses each sync with this probability (rejoins)
  return dl


def compressing(cm) -> bool:
  """Whether the `comm` section makes the gradient reduction over comm.axis anything but plain
  float32 data parallelism."""
  return cm.format != "f32" or cm.error_feedback != "none"


def per_replica_state(cfg) -> bool:
  """Whether the optimizer keeps one copy of some state per shard of comm.axis (DiLoCo, error
  feedback)."""
  return bool(cfg.diloco.inner_steps) or cfg.comm.error_feedback != "none"


def manual_axis(cfg) -> str:
  """The mesh axis the train step runs manual over ("" = none): comm.axis when compressing or
  running DiLoCo, else optim.reduce_axis."""
  return cfg.comm.axis if compressing(cfg.comm) or cfg.diloco.inner_steps else cfg.optim.reduce_axis


def validate_comm(cfg, shape) -> None:
  """The comm and diloco sections' checks (and what an explicit reduction needs of the others)."""
  cm, dl, o, m = cfg.comm, cfg.diloco, cfg.optim, cfg.model
  if cfg.train.offload in ("optimizer", "params") and manual_axis(cfg):
    raise ConfigError(f"train.offload={cfg.train.offload} with a step manual over "
                      f"{manual_axis(cfg)!r} (an explicit reduction or DiLoCo) is not supported; "
                      f"offload activations or nothing")
  axis, cp = manual_axis(cfg), shape["context"]
  if axis and cp > 1:
    raise ConfigError(f"the context axis ({cp}) with an explicit reduction over {axis} "
                      "(compression, DiLoCo, optim.reduce_axis): not supported yet "
                      "(set --config.mesh.context=1)")
  if axis and shape["stage"] > 1:  # the pipeline's shard_map does not nest in the step's yet
    raise ConfigError(f"mesh.stage={shape['stage']} with an explicit reduction over {axis} "
                      "(compression, DiLoCo, optim.reduce_axis): not supported yet "
                      "(set --config.mesh.stage=1)")
  if m.n_experts and axis and math.prod(shape[a] for a in DATA_AXES if a != axis) > 1:
    raise ConfigError(
        f"an explicit reduction over {axis} (compression, DiLoCo, optim.reduce_axis) with experts "
        "needs the other data axes at size 1: the experts' shard_map cannot nest in the step's "
        f"yet (set --config.mesh.{axis}={math.prod(shape[a] for a in DATA_AXES)})")
  check_floats("comm", cm, RANGES)
  check_floats("diloco", dl, RANGES)
  check_choice("comm.axis", cm.axis, ("replica", "data"))
  check_choice("comm.error_feedback", cm.error_feedback, ERROR_FEEDBACK)
  check_choice("comm.kernel", cm.kernel, COMM_KERNELS)
  if cm.block < 2 or cm.block % 2:
    raise ConfigError(
        f"comm.block={cm.block} must be a positive even number (int4 packs two values "
        "per byte)")
  on = compressing(cm) or dl.inner_steps
  if on and shape[cm.axis] < 2:
    raise ConfigError(f"comm: the {cm.axis} axis has size {shape[cm.axis]}; compression and DiLoCo "
                      f"need at least 2 (set --config.mesh.{cm.axis}=N)")
  if on and o.reduce_axis and o.reduce_axis != cm.axis:
    raise ConfigError(f"optim.reduce_axis={o.reduce_axis!r} differs from comm.axis={cm.axis!r}")
  if dl.inner_steps < 0:
    raise ConfigError(f"diloco.inner_steps must be >= 0 (0 = off), got {dl.inner_steps}")
  if dl.inner_steps:
    _validate_diloco(cm, dl, m)


def _validate_diloco(cm, dl, m):
  if compressing(cm):
    raise ConfigError(
        "comm.format/comm.error_feedback compress per-step gradients, which DiLoCo does "
        "not send: set diloco.format instead")
  if not 1 <= dl.fragments <= m.n_layers:
    raise ConfigError(
        f"diloco.fragments={dl.fragments} must be in [1, model.n_layers={m.n_layers}]")
  if dl.inner_steps % dl.fragments:
    raise ConfigError(f"diloco.fragments={dl.fragments} must divide diloco.inner_steps="
                      f"{dl.inner_steps}")
  if not 0 <= dl.delay < dl.inner_steps:
    raise ConfigError(
        f"diloco.delay={dl.delay} must be in [0, diloco.inner_steps={dl.inner_steps})")
