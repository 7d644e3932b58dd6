"""`build(cfg)`: the whole optimizer as one optax chain, from the `optim` config section."""

from typing import Callable, NamedTuple

import jax
import optax

from jaxtrain import config as config_lib, wire
from jaxtrain.kernels import platform
from jaxtrain.optim import compress, reduce
from jaxtrain.optim import diloco as diloco_lib
from jaxtrain.optim.guard import skip_nonfinite
from jaxtrain.optim.schedules import make_schedule

# Muon orthogonalizes each layer matrix over (reduction, output) axes; axis 0 is the layer axis.
_MUON_DIMS = {
    "q": ((1,), (2, 3)), "k": ((1,), (2, 3)), "v": ((1,), (2, 3)), "o": ((1, 2), (3,)),
    "gate": ((1,), (2,)), "up": ((1,), (2,)), "down": ((1,), (2,)),
}


def _leaf_name(path) -> str:
  """The parameter's name: its last dict key (a logical-axis box around the leaf adds an attribute
  key)."""
  return [p.key for p in path if isinstance(p, jax.tree_util.DictKey)][-1]


def decay_mask(params):
  """True for weights that get decoupled weight decay: matrices, not norm scales or biases."""
  def is_decayed(path, _):
    names = [str(getattr(p, "key", p)) for p in path]
    return not any("norm" in n or n == "bias" for n in names)
  return jax.tree_util.tree_map_with_path(is_decayed, params)


def muon_dims(params):
  """Muon's dimension numbers for layer matrices; None sends a leaf to Muon's AdamW."""
  def dims(path, _):
    in_layers = any(str(getattr(p, "key", p)) == "layers" for p in path)
    spec = _MUON_DIMS.get(_leaf_name(path)) if in_layers else None
    return None if spec is None else optax.contrib.MuonDimensionNumbers(*spec)
  return jax.tree_util.tree_map_with_path(dims, params)


class Outer(NamedTuple):
  """What the step and the loop need to know of the reduction the chain is built with: the mesh axis
  the step runs manual over ("": none, GSPMD reduces the global batch), whether metrics stay per
  shard (DiLoCo: nothing crosses the axis between syncs), and `loss_params(opt_state)`, where the
  loss's params live when they are not the global ones (None: the global params)."""
  axis: str = ""
  local_metrics: bool = False
  loss_params: Callable | None = None


def outer(cfg) -> Outer:
  """The reduction of a config, as `build` makes it; its axis is `config.manual_axis` (the one rule,
  also what validation checks the other axes against)."""
  if cfg.diloco.inner_steps:
    return Outer(config_lib.manual_axis(cfg), True, diloco_lib.loss_params)
  return Outer(config_lib.manual_axis(cfg))


def build(o, steps: int, comm=None, diloco=None, shards: int = 1,
          seed: int = 0) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """From the `optim` config section and the run's length: [explicit or compressed reduction ->]
  skip non-finite (clip -> AdamW | Muon with the schedule); with the `diloco` section on, DiLoCo
  around that as its inner optimizer. `comm`, `diloco`: those config sections; `shards`: the size of
  comm.axis."""
  if comm is not None:
    wire.check("comm.format", comm.format)
  if diloco is not None:
    wire.check("diloco.format", diloco.format)
  schedule = make_schedule(o, steps)
  if o.name == "adamw":
    inner = optax.adamw(schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask)
  else:
    inner = optax.contrib.muon(
        schedule, beta=o.b1, weight_decay=o.weight_decay, weight_decay_mask=decay_mask,
        adam_b1=o.b1, adam_b2=o.b2, adam_weight_decay=o.weight_decay,
        muon_weight_dimension_numbers=muon_dims)
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  tx = optax.chain(*parts, inner)
  # counted in the state, read by name: `total_notfinite`, `consecutive_skips`
  if o.skip_nonfinite:
    tx = skip_nonfinite(tx)
  if diloco is not None and diloco.inner_steps:  # each replica skips its own non-finite steps
    d = diloco
    tx = diloco_lib.diloco(tx, axis=comm.axis, shards=shards, inner_steps=d.inner_steps,
                           outer_lr=d.outer_lr, outer_momentum=d.outer_momentum, fmt=d.format,
                           block=comm.block, fragments=d.fragments, delay=d.delay, mix=d.mix,
                           drop_prob=d.drop_prob, seed=seed)
  elif comm is not None and config_lib.compressing(comm):
    if comm.kernel == "pallas" and platform.backend() == "cpu":
      raise config_lib.ConfigError(
          "comm.kernel=pallas runs on GPU and TPU only (jax's Pallas interpreter cannot run inside "
          "the step's shard_map); use comm.kernel=xla on CPU: the same bits")
    tx = optax.chain(compress.compressed_sum(comm.axis, shards, comm.format, comm.block,
                                             comm.error_feedback, comm.kernel), tx)
  elif o.reduce_axis:  # before the finiteness check: every shard must take the same decision
    tx = optax.chain(reduce.sum_over(o.reduce_axis), tx)
  return tx, schedule
