"""The `checkpoint` section: two tiers (persistent, fast) and when each saves, defaults and
checks. No jax import here."""

import ml_collections

from jaxtrain.config.errors import ConfigError, check_floats


def checkpoint_defaults() -> ml_collections.ConfigDict:
  k = ml_collections.ConfigDict()
  k.every_steps = 0  # persistent tier: save every n steps (0: by seconds / at the end only)
  # persistent tier: also save when this many seconds passed since its last save
  k.every_seconds = 0.0
  k.dir = ""  # persistent tier: a path or TensorStore URL (gs://, s3://); "" = WORKDIR/checkpoints
  # s3:// tiers: the S3-compatible endpoint URL; "" = $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL or AWS
  k.s3_endpoint = ""
  k.keep = 2  # persistent tier: keep the newest n steps
  k.keep_every_steps = 0  # persistent tier: also keep every step divisible by this (0: none)
  k.fast_dir = ""  # fast tier (local disk, RAM disk); "" = no fast tier
  k.fast_every_steps = 0  # fast tier: save every n steps
  k.fast_every_seconds = 0.0  # fast tier: and/or every this many seconds
  k.fast_keep = 1  # fast tier: keep the newest n steps
  k.max_failed_saves = 3  # end the run (exit status 5) when this many saves of a tier fail in a row
  # Adaptive: between min and max steps apart, sooner while the loss is unstable
  # (checkpoint/policy.py).
  k.adaptive = False
  k.adaptive_min_steps = 10
  k.adaptive_max_steps = 200
  k.adaptive_spike = 0.1  # a loss above (1 + spike) x its running median is unstable
  # read hardware health (GPU ECC/throttling/temperature, tier disks, host memory) every n steps:
  # a hardware_health row, and a risk that shortens the adaptive interval (train/hardware.py); 0: off
  k.health_every_steps = 100
  # Orbax's OCDBT key-value store (few files; best on object stores); False: a zarr dir per array
  k.ocdbt = True
  # zstd on the arrays: barely smaller for trained weights, much slower (benchmarks/RESULTS.md)
  k.compress = False
  k.init_from = ""  # start from the params of another checkpoint (a converted HF model, a run dir)
  return k


def validate_checkpoint(cfg) -> None:
  k = cfg.checkpoint
  for key in ("every_steps", "keep_every_steps", "fast_every_steps", "health_every_steps"):
    if k[key] < 0:
      raise ConfigError(f"checkpoint.{key} must be >= 0, got {k[key]}")
  if k.every_seconds < 0 or k.fast_every_seconds < 0:
    raise ConfigError("checkpoint.every_seconds and checkpoint.fast_every_seconds must be >= 0")
  if k.max_failed_saves < 1:
    raise ConfigError(f"checkpoint.max_failed_saves must be >= 1, got {k.max_failed_saves}")
  if k.keep < 1 or k.fast_keep < 1:
    raise ConfigError(f"checkpoint.keep and checkpoint.fast_keep must be >= 1, got {k.keep} and "
                      f"{k.fast_keep}")
  if k.adaptive and not 1 <= k.adaptive_min_steps <= k.adaptive_max_steps:
    raise ConfigError(f"checkpoint.adaptive_min_steps={k.adaptive_min_steps} must be in [1, "
                      f"checkpoint.adaptive_max_steps={k.adaptive_max_steps}]")
  if k.adaptive and k.adaptive_spike <= 0:
    raise ConfigError(f"checkpoint.adaptive_spike must be positive, got {k.adaptive_spike}")
  if k.fast_dir and not (k.fast_every_steps or k.fast_every_seconds or k.adaptive):
    raise ConfigError("checkpoint.fast_dir is set but nothing saves to it: set "
                      "checkpoint.fast_every_steps, fast_every_seconds or adaptive")
  check_floats("checkpoint", k, {})
