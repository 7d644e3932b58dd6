"""The config's checks: `validate(cfg, device_count)` runs each section's checks once, before
anything is compiled, and raises `ConfigError` with one line for a config that cannot run;
`incompatible` lists what a resumed run may not change. No jax import here."""

from jaxtrain.config.checkpoint import validate_checkpoint
from jaxtrain.config.comm import validate_comm
from jaxtrain.config.data import validate_data
from jaxtrain.config.errors import flat
from jaxtrain.config.eval import validate_eval
from jaxtrain.config.mesh import validate_mesh
from jaxtrain.config.model import validate_model
from jaxtrain.config.optim import validate_optim
from jaxtrain.config.posttrain import validate_posttrain
from jaxtrain.config.sample import validate_sample
from jaxtrain.config.schema import default_config
from jaxtrain.config.train import validate_train

# Keys a resumed run may change: where and how often it runs, logs and saves, not what it computes.
RESUMABLE_CHANGES = (
    "mesh.", "checkpoint.", "sample.", "eval.", "train.steps", "train.log_every",
    "train.eval_every",
    "optim.max_consecutive_skips", "optim.on_divergence", "optim.max_rollbacks",
    "train.eval_batches", "train.microbatches", "train.pipeline_microbatches",
    "model.pipeline_repeats", "data.prefetch", "data.prepare_workers",
    "data.cache_dir", "train.peer_timeout_s", "train.gpu_hour_price", "train.device_memory_gib",
    "train.offload", "train.compilation_cache", "train.steps_per_call")


def validate(cfg, device_count: int) -> dict[str, int]:
  """Raises ConfigError (one line) for a config that cannot run; returns the mesh shape."""
  shape = validate_mesh(cfg, device_count)
  validate_model(cfg, shape)
  validate_train(cfg, shape)
  validate_data(cfg)
  validate_posttrain(cfg, shape)
  validate_optim(cfg)
  validate_comm(cfg, shape)
  validate_checkpoint(cfg)
  validate_sample(cfg)
  validate_eval(cfg)
  return shape


def incompatible(saved: dict, current: dict) -> list[str]:
  """The `key: saved -> current` differences that forbid resuming a run saved with `saved`.

  A key the saved config lacks (added to the schema since) reads as its default: the run was made
  with it."""
  defaults = flat(default_config().to_dict())
  a, b = {**defaults, **flat(saved)}, flat(current)
  return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}"
          for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and not any(k == r or (r.endswith(".") and k.startswith(r))
                                               for r in RESUMABLE_CHANGES)]
