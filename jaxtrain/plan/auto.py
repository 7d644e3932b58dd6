"""train.batch_size=auto and train.microbatches=auto: the planner picks the largest batch (or the
fewest microbatches) whose predicted per-device memory fits the device less MARGIN, a compile of the
real step confirms it (memory_analysis within the limit; otherwise one batch step smaller until it
is), and the choice is recorded: the resolved config (config.json), an `auto_batch` event row in
metrics.jsonl (written by the loop) and one log line.

The limit: train.device_memory_gib when positive (on CPU, where nothing else bounds a device, set
it), else the device's own (jax's bytes_limit where the backend reports one, else the planner's
table)."""

import copy

import jax

from jaxtrain import config as config_lib
from jaxtrain.plan import devices as devices_lib
from jaxtrain.plan.estimate import gib, predict

MAX_STEPS = 1 << 16  # the largest batch tried is this many batch steps
# The planner's prediction must fit this much below the limit: its memory was within 8% of XLA:CPU's
# on every compiled step it was checked against (benchmarks/RESULTS.md, "Planner"), so the compile
# rarely refuses.
MARGIN = 0.10


def memory_limit(cfg, devices) -> float:
  if cfg.train.device_memory_gib > 0:
    return cfg.train.device_memory_gib * 2**30
  stats = devices[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  return devices_lib.memory_bytes(devices_lib.detect(), len(devices))


def with_train(cfg, **values):
  cfg = copy.deepcopy(cfg)
  with cfg.train.ignore_type():
    for key, value in values.items():
      cfg.train[key] = value
  return cfg


def _fits(cfg, n: int, kind: str, limit: float) -> bool:
  """Whether `cfg` is predicted to fit `limit` less MARGIN."""
  try:
    return predict(cfg, n, kind, limit, suggest=False).memory["total"] <= (1 - MARGIN) * limit
  except config_lib.ConfigError:
    return False


def largest_batch(cfg, n: int, kind: str, limit: float, microbatches: int) -> tuple[int, int]:
  """(largest batch predicted to fit, the batch step): multiples of data-like ways x
  microbatches."""
  shape = config_lib.mesh_shape(cfg.mesh, n)
  step = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"] * microbatches
  fits = lambda k: _fits(with_train(cfg, batch_size=k * step, microbatches=microbatches), n, kind,
                         limit)
  if not fits(1):
    return 0, step
  lo, hi = 1, 2
  while hi <= MAX_STEPS and fits(hi):
    lo, hi = hi, hi * 2
  while hi - lo > 1:  # fits(lo), not fits(hi)
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo * step, step


def fewest_microbatches(cfg, n: int, kind: str, limit: float) -> int:
  """The fewest microbatches (dividing each data shard's rows) predicted to fit; 0 if none does."""
  for k in range(1, cfg.train.batch_size + 1):
    if _fits(with_train(cfg, microbatches=k), n, kind, limit):
      return k
  return 0


def choose(cfg, n: int, kind: str, limit: float) -> dict:
  """The planner's choice without compiling: {"batch_size", "microbatches", "step"} (step: the batch
  step, 0 when the batch is given). ConfigError (one line) when nothing fits."""
  t = cfg.train
  if t.batch_size == config_lib.AUTO:
    microbatches = 1 if t.microbatches == config_lib.AUTO else t.microbatches
    batch, step = largest_batch(cfg, n, kind, limit, microbatches)
    if not batch:
      raise config_lib.ConfigError(
          f"train.batch_size=auto: even {step} sequences do not fit {gib(limit)} per "
          f"device (python -m jaxtrain plan says what would)")
    return {"batch_size": batch, "microbatches": microbatches, "step": step}
  microbatches = fewest_microbatches(cfg, n, kind, limit)
  if not microbatches:
    raise config_lib.ConfigError(
        f"train.microbatches=auto: no microbatch count fits train.batch_size="
        f"{t.batch_size} in {gib(limit)} per device")
  return {"batch_size": t.batch_size, "microbatches": microbatches, "step": 0}


def resolve(cfg, devices=None) -> tuple:
  """(cfg, None) when neither train.batch_size nor train.microbatches is auto; else (a copy with
  them chosen, predicted then confirmed by compiling the step, and the metrics row that records the
  choice), after one log line."""
  t = cfg.train
  if config_lib.AUTO not in (t.batch_size, t.microbatches):
    return cfg, None
  from jaxtrain.plan.compiled import compiled_memory
  devices = jax.devices() if devices is None else devices
  kind, limit = devices_lib.detect(), memory_limit(cfg, devices)
  # the rest first
  config_lib.validate(with_train(cfg, batch_size=len(devices), microbatches=1), len(devices))
  choice = choose(cfg, len(devices), kind, limit)
  while True:
    chosen = with_train(cfg, batch_size=choice["batch_size"], microbatches=choice["microbatches"])
    compiled = compiled_memory(chosen, devices)["total"]
    if compiled <= limit or choice["batch_size"] <= choice["step"] or not choice["step"]:
      break
    choice["batch_size"] -= choice["step"]  # the prediction was optimistic: one batch step down
  if compiled > limit:
    raise config_lib.ConfigError(
        f"train.batch_size/microbatches=auto: the compiled step needs {gib(compiled)} "
        f"per device, over the limit of {gib(limit)}")
  predicted = predict(chosen, len(devices), kind, limit, suggest=False).memory["total"]
  row = {"event": "auto_batch", **{k: choice[k] for k in ("batch_size", "microbatches")},
         "predicted_bytes": predicted, "compiled_bytes": compiled, "limit_bytes": limit}
  if jax.process_index() == 0:
    print(f"auto: train.batch_size={choice['batch_size']} "
          f"train.microbatches={choice['microbatches']} "
          f"(predicted {gib(predicted)}, compiled {gib(compiled)} per device, limit {gib(limit)})",
          flush=True)
  return chosen, row
