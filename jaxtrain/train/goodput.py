"""Goodput (where the job's wall time went) and energy (GPU board power integrated over time).

Goodput as MaxText and Google's ML Goodput Measurement define it: the time spent on productive,
preserved training steps divided by the job's total elapsed time; the rest is badput, by cause. The
loop charges every interval of a run to exactly one bucket at its boundaries (`charge`), so the
buckets add up to the run's wall time:

  productive  train steps whose progress is kept (dispatch, device time, reading the metrics back)
  init        startup: building the task, preparing data, creating the state (not a restore)
  data        waiting for the next host batch
  compile     compiling the train step (the eval step compiles inside its first evaluation)
  checkpoint  the loop blocked in saves: a due save's blocking part, the final save, waiting for
              saves in flight
  restore     reading a checkpoint (at resume or a rollback)
  eval        evaluations
  lost        wasted progress: productive time of steps recomputed after a restart (resumed from
              an older step than the last one computed) or a rollback; moved out of productive

A job spans runs on the same workdir: a resumed run reads the cumulative buckets of the previous one
from metrics.jsonl and the steps it computed (rows with `goodput_*` fields). Wall time is the runs'
own time summed (the gap between a crash and its restart is not seen from inside). A run that dies
without its final row loses the record of what it did after its last logged row: the steps in flight
(one with log_every=1) are recomputed but not counted, and its last seconds are in no bucket.
Energy: NVML board power of this process's GPUs, sampled on a background thread and integrated by
the trapezoid rule, times the process count.
"""

import os
import threading
import time
from typing import Callable

BUCKETS = ("init", "data", "compile", "checkpoint", "restore", "eval", "lost")
POWER_INTERVAL_S = 0.1  # seconds between board-power samples
# steps of the trail kept at full resolution; older ones are thinned (interpolated between)
TRAIL = 4096


class Goodput:
  """Cumulative seconds per bucket since the job began, and the steps recomputed.

  `clock` is injectable for tests. `trail` is [(step, productive seconds when it finished)] of the
  current trajectory, for `rewind`."""

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self.clock = clock
    self.start = self.mark = clock()
    self.productive, self.lost_steps, self.restarts = 0.0, 0, 0
    self.bad = dict.fromkeys(BUCKETS, 0.0)
    self.before = 0.0  # wall seconds of the job's earlier runs
    self.trail: list[tuple[int, float]] = []
    self.energy: "EnergyMeter | None" = None
    self.energy_before = 0.0

  def charge(self, bucket: str, step: int | None = None) -> float:
    """Charges the time since the last boundary to `bucket` ("step": productive; `step` then records
    that step as finished). Returns the seconds charged."""
    now = self.clock()
    seconds, self.mark = now - self.mark, now
    if bucket == "step":
      self.productive += seconds
      if step is not None and (not self.trail or step > self.trail[-1][0]):
        self.trail.append((step, self.productive))
        if len(self.trail) > 2 * TRAIL:  # a long run: every other old entry goes
          self.trail = self.trail[:-TRAIL][::2] + self.trail[-TRAIL:]
    else:
      self.bad[bucket] += seconds
    return seconds

  def productive_at(self, step: int) -> float:
    """Productive seconds when `step` finished, interpolated between recorded steps of the trail."""
    before = [(s, p) for s, p in self.trail if s <= step]
    after = [(s, p) for s, p in self.trail if s > step]
    if not before:
      return after[0][1] * step / after[0][0] if after and after[0][0] > 0 else 0.0
    (s0, p0) = before[-1]
    if s0 == step or not after:
      return p0
    (s1, p1) = after[0]
    return p0 + (p1 - p0) * (step - s0) / (s1 - s0)

  def rewind(self, to_step: int, from_step: int):
    """Training goes back from `from_step` (the newest step computed) to `to_step` (a checkpoint):
    the productive time of the steps in between becomes lost."""
    if from_step <= to_step:
      return
    lost = max(self.productive_at(from_step) - self.productive_at(to_step), 0.0)
    self.productive -= lost
    self.bad["lost"] += lost
    self.lost_steps += from_step - to_step
    self.trail = [(s, p) for s, p in self.trail if s < to_step] + [(to_step, self.productive)]

  def resume(self, rows: list[dict], restored_step: int):
    """Continues the job that wrote `rows` (metrics.jsonl) from its checkpoint `restored_step`: its
    cumulative buckets come back, and the steps it computed after `restored_step` count as lost."""
    previous = [r for r in rows if "goodput_wall_s" in r]
    if not previous:
      return
    last = previous[-1]
    self.before = last["goodput_wall_s"]
    self.productive += last["goodput_productive_s"]
    for name in BUCKETS:
      self.bad[name] += last.get(f"badput_{name}_s", 0.0)
    self.lost_steps += last.get("lost_steps", 0)
    self.restarts = last.get("restarts", 0) + 1
    self.energy_before = last.get("energy_j", 0.0)
    # The trajectory that led to the last row: walking back, each kept row has a lower step than the
    # one after it (rows of steps that an earlier restart recomputed are skipped).
    trail = []
    for r in reversed([r for r in previous if "event" not in r]):
      if not trail or r["step"] < trail[-1][0]:
        trail.append((r["step"], r["goodput_productive_s"]))
    self.trail = trail[::-1]
    newest = max(last["step"], self.trail[-1][0] if self.trail else 0)
    self.trail.append((newest, last["goodput_productive_s"]))
    self.rewind(restored_step, newest)

  def wall(self) -> float:
    return self.before + self.clock() - self.start

  def row(self, step: int, tokens_per_step: int = 0, price: float = 0.0, units: int = 1) -> dict:
    """The cumulative columns of a metrics row at `step`: goodput, each bucket, and energy and cost
    when known."""
    wall = self.wall()
    out = {"goodput": self.productive / wall if wall > 0 else 0.0, "goodput_wall_s": wall,
           "goodput_productive_s": self.productive,
           **{f"badput_{k}_s": v for k, v in self.bad.items()},
           "lost_steps": self.lost_steps, "restarts": self.restarts}
    tokens = step * tokens_per_step  # tokens of the kept steps
    if self.energy is not None:
      out["energy_j"] = self.energy_before + self.energy.joules()
      out["power_w"] = self.energy.watts
      if tokens:
        out["joules_per_token"] = out["energy_j"] / tokens
    if price > 0 and tokens:
      out["cost_per_mtok"] = price * units * wall / 3600 / (tokens / 1e6)
    return out


def summary(row: dict) -> str:
  """One paragraph from a `row`: goodput, the badput buckets, recomputed steps, energy and cost."""
  lost = ", ".join(
      f"{name} {row[f'badput_{name}_s']:.2f} s" for name in BUCKETS if row[f"badput_{name}_s"] > 0)
  text = (f"goodput {row['goodput']:.1%}: {row['goodput_productive_s']:.2f} s of productive steps "
          f"in {row['goodput_wall_s']:.2f} s since the job began ({row['restarts']} restarts); "
          f"badput: {lost or 'none'}; {row['lost_steps']} steps recomputed")
  if "energy_j" in row:
    text += f"; energy {row['energy_j'] / 1e3:.3g} kJ (last {row['power_w']:.0f} W)"
    if "joules_per_token" in row:
      text += f", {row['joules_per_token']:.3g} J/token"
  if "cost_per_mtok" in row:
    text += f"; {row['cost_per_mtok']:.4g} per million tokens at train.gpu_hour_price"
  return text + "."


def history(workdir: str) -> list[dict]:
  """The rows of the workdir's metrics.jsonl (written by process 0), or [] where this process cannot
  see it."""
  from jaxtrain.metrics import read_metrics
  return read_metrics(workdir) if os.path.isfile(os.path.join(workdir, "metrics.jsonl")) else []


class EnergyMeter:
  """Integrates power samples (watts from `read_watts`) over time by the trapezoid rule. `sample()`
  takes one; `start()` runs a thread that samples every `interval_s` until `stop()`."""

  def __init__(self, read_watts: Callable[[], float], interval_s: float = POWER_INTERVAL_S,
               clock: Callable[[], float] = time.perf_counter, scale: float = 1.0):
    self.read_watts, self.interval_s, self.clock, self.scale = read_watts, interval_s, clock, scale
    self._joules, self._last, self.watts = 0.0, None, 0.0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = None

  def sample(self):
    t, w = self.clock(), self.scale * self.read_watts()
    with self._lock:
      if self._last is not None:
        t0, w0 = self._last
        self._joules += (t - t0) * (w + w0) / 2
      self._last, self.watts = (t, w), w

  def joules(self) -> float:
    with self._lock:
      return self._joules

  def start(self) -> "EnergyMeter":
    self.sample()
    self._thread = threading.Thread(target=self._run, name="jaxtrain-power", daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop.wait(self.interval_s):
      try:
        self.sample()
      except Exception:  # the driver went away: keep what was integrated
        return

  def stop(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
      self.sample()  # up to now


def nvml_handles(local_hardware_ids: list[int]):
  """(pynvml, NVML handles) of these CUDA devices (`pynvml` from nvidia-ml-py), or None when NVML
  is not there. CUDA_VISIBLE_DEVICES maps CUDA ordinals to NVML indices when it lists integers."""
  try:
    import pynvml
    pynvml.nvmlInit()
  except Exception:  # not installed, or no NVIDIA driver
    return None
  visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
  if all(v.strip().isdigit() for v in visible):
    ids = [int(visible[i]) if i < len(visible) else i for i in local_hardware_ids]
  else:
    ids = list(local_hardware_ids)
  try:
    return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids]
  except Exception:
    return None


def nvml_power_reader(local_hardware_ids: list[int]) -> Callable[[], float] | None:
  """Watts drawn by the boards of these CUDA devices (NVML), or None when NVML is not there."""
  found = nvml_handles(local_hardware_ids)
  if found is None:
    return None
  pynvml, handles = found
  return lambda: sum(pynvml.nvmlDeviceGetPowerUsage(h) for h in handles) / 1e3  # milliwatts


def gpu_energy_meter() -> EnergyMeter | None:
  """A started meter of this process's GPUs, scaled by the process count (hosts alike), or None off
  GPUs or without NVML."""
  import jax
  if jax.default_backend() != "gpu":
    return None
  read = nvml_power_reader([d.local_hardware_id for d in jax.local_devices()])
  return None if read is None else EnergyMeter(read, scale=jax.process_count()).start()
