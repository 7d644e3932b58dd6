"""Out of memory, as one line with the planner's advice (errors.OutOfMemory, exit status 7).

Two ways a run meets it: XLA fails an allocation while compiling or running the step
(`RESOURCE_EXHAUSTED`, on any backend: `is_out_of_memory`), or, on the CPU backend, the host has
less memory free than the planner predicts the step needs (`check_host`, before anything is
allocated: a machine whose memory is mostly taken gets the line instead of swapping or being killed).
The advice is what `python -m jaxtrain plan` proposes: the planner's single changes that fit (more
microbatches, remat, chunked cross-entropy, a smaller batch).

A kernel OOM kill (SIGKILL) cannot be caught by the process: its parent sees status -9 (a shell 137).
"""

import os
import resource

from jaxtrain import config as config_lib, errors
from jaxtrain.plan import devices as devices_lib
from jaxtrain.plan.estimate import gib, memory_bytes, predict, suggestions

# the line's advice: at most this many of the planner's suggestions
SHOWN = 2


def is_out_of_memory(e: BaseException) -> bool:
  """Whether `e` is an allocation that failed: XLA's RESOURCE_EXHAUSTED or Python's MemoryError."""
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e).split("\n", 1)[0]


def host_available() -> float:
  """Bytes this process may still allocate on the host: the least of the machine's available
  memory, its cgroup's room (v2 and v1) and its address-space limit (ulimit -v) less what it has
  mapped."""
  import psutil
  room = [float(psutil.virtual_memory().available)]
  for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                      ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                       "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
    try:
      with open(limit) as f, open(used) as g:
        text = f.read().strip()
        if text != "max" and int(text) < 1 << 60:
          room.append(float(int(text) - int(g.read())))
    except (OSError, ValueError):
      pass
  soft = resource.getrlimit(resource.RLIMIT_AS)[0]
  if soft != resource.RLIM_INFINITY:
    room.append(float(soft - psutil.Process().memory_info().vms))
  return max(min(room), 0.0)


def advice(cfg, n_devices: int, kind: str, limit: float, need: bool = True) -> str:
  """The planner's predicted need per device (with `need`) and its changes that fit `limit` per
  device."""
  if config_lib.AUTO in (cfg.train.batch_size, cfg.train.microbatches):
    return "lower train.device_memory_gib so that train.batch_size=auto picks a smaller batch"
  try:
    total = predict(cfg, n_devices, kind, limit, suggest=False).memory["total"]
    # predicted to fit but it did not: ask for what fits in half the prediction
    fixes = suggestions(cfg, n_devices, kind, limit if total > limit else total / 2)
  except config_lib.ConfigError as e:
    return f"the planner cannot say ({e})"
  said = f"the planner predicts ~{gib(total)} per device; " if need else ""
  return f"{said}would fit with: " + "; or ".join(fixes[:SHOWN])


def failed(cfg, n_devices: int, e: BaseException) -> errors.OutOfMemory:
  """errors.OutOfMemory for an allocation XLA (or Python) refused while the run compiled or ran."""
  kind = devices_lib.detect()
  limit = devices_lib.memory_bytes(kind, n_devices)
  if cfg.train.device_memory_gib > 0:
    limit = cfg.train.device_memory_gib * 2**30
  first = str(e).split("\n", 1)[0].strip().rstrip(".") or type(e).__name__
  return errors.OutOfMemory(f"out of memory: {first[:160]}; "
                            f"{advice(cfg, n_devices, kind, limit)}")


def check_host(cfg, n_devices: int, local_devices: int) -> None:
  """On the CPU backend: errors.OutOfMemory when the host has less memory available than the
  planner predicts this process's devices need (state, batch and the step's peak)."""
  if devices_lib.detect() != "cpu" or config_lib.AUTO in (cfg.train.batch_size,
                                                         cfg.train.microbatches):
    return
  try:  # the memory part of `predict` only (its step time would probe the CPU's peak)
    need = memory_bytes(cfg, config_lib.validate(cfg, n_devices), "cpu")[0]["total"]
  except config_lib.ConfigError:  # a config the planner does not model: nothing to check against
    return
  need *= local_devices
  available = host_available()
  if need > available:
    limit = available / local_devices
    raise errors.OutOfMemory(
        f"out of memory: the step needs ~{gib(need)} on this host ({local_devices} device(s)), "
        f"{gib(available)} available; {advice(cfg, n_devices, 'cpu', limit, need=False)}")
