"""Hardware health: a risk score in [0, 1], read every `checkpoint.health_every_steps` steps, that
the adaptive checkpoint policy turns into a shorter interval (checkpoint/policy.py,
`AdaptivePolicy.hardware`).

Parts, each in [0, 1]; None where this host cannot measure it (no NVIDIA GPU, no NVML, no
/proc/meminfo), reported as absent:
  ecc      new volatile ECC errors on this process's GPUs since the previous reading (NVML):
           1 for any uncorrected one, else min(1, new corrected / ECC_CORRECTED)
  thermal  1 while a GPU is throttled by hardware (slowdown, thermal, power brake) or by the
           driver's thermal slowdown (NVML clock-event reasons), else its temperature's place
           between TEMP_OK and TEMP_HOT degrees C
  disk     each local checkpoint tier's directory: 0 with FREE_OK of its disk free or more, 1 at
           FREE_LOW or less, linear between (shutil.disk_usage)
  memory   host memory: the same scale on MemAvailable / MemTotal (/proc/meminfo)
risk = the largest part over the parts and over every process of the run (processes decide
alike). A reader raising is counted absent for that reading, never an error.
"""

import dataclasses
import json
import os
import shutil
from typing import Callable

ECC_CORRECTED = 10  # new corrected errors in one interval that count as a failing board
TEMP_OK, TEMP_HOT = 80.0, 90.0  # degrees C: risk 0 below, 1 above (H100/H200 slow down near 87-90)
FREE_OK, FREE_LOW = 0.10, 0.05  # free share of a disk, of host memory
# NVML clock-event (throttle) reasons that mean the board is in trouble, not merely idle or capped
THROTTLE = {0x8: "hardware slowdown", 0x20: "thermal slowdown (driver)",
            0x40: "thermal slowdown (hardware)", 0x80: "power brake"}
PARTS = ("ecc", "thermal", "disk", "memory")


@dataclasses.dataclass
class Gpu:
  """One GPU's reading; None where NVML does not support the query."""
  uncorrected: int | None = None  # volatile ECC error counts (since the driver loaded)
  corrected: int | None = None
  throttle: int | None = None  # clock-event reasons, a bit mask
  temperature: float | None = None


def nvml_reader(local_hardware_ids: list[int]) -> Callable[[], list[Gpu]] | None:
  """This process's GPUs read through NVML, or None without NVML (goodput.nvml_handles)."""
  from jaxtrain.train import goodput
  found = goodput.nvml_handles(local_hardware_ids)
  if found is None:
    return None
  nvml, handles = found

  def query(fn, *args):
    try:
      return fn(*args)
    except Exception:  # NotSupported: ECC off, an older board or driver
      return None

  reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
      nvml.nvmlDeviceGetCurrentClocksThrottleReasons
  volatile, gpu_sensor = 0, 0  # NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU
  uncorrected, corrected = 1, 0  # NVML_MEMORY_ERROR_TYPE_*
  return lambda: [
      Gpu(query(nvml.nvmlDeviceGetTotalEccErrors, h, uncorrected, volatile),
          query(nvml.nvmlDeviceGetTotalEccErrors, h, corrected, volatile), query(reasons, h),
          query(nvml.nvmlDeviceGetTemperature, h, gpu_sensor)) for h in handles]


def disk_reader(dirs: dict[str, str]) -> Callable[[], dict[str, tuple[int, int]]]:
  """{tier: (free bytes, total bytes)} of each local tier directory (its nearest existing parent
  before the first save); object-store URLs are left out."""
  def read():
    out = {}
    for name, directory in dirs.items():
      if "://" in directory:
        continue
      path = os.path.abspath(directory)
      while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
      usage = shutil.disk_usage(path)
      out[name] = (usage.free, usage.total)
    return out
  return read


def memory_reader(path: str = "/proc/meminfo") -> Callable[[], tuple[int, int]] | None:
  """(available bytes, total bytes) of host memory, or None where `path` is missing."""
  if not os.path.isfile(path):
    return None

  def read():
    fields = {}
    with open(path) as f:
      for line in f:
        key, _, value = line.partition(":")
        fields[key] = int(value.split()[0]) * 1024  # kB
    return fields["MemAvailable"], fields["MemTotal"]
  return read


def _scale(share: float) -> float:
  """0 at FREE_OK or more of free share, 1 at FREE_LOW or less."""
  return min(1.0, max(0.0, (FREE_OK - share) / (FREE_OK - FREE_LOW)))


class Health:
  """Reads the parts (`read`): the readers are callables (None: that part is absent), injectable in
  tests. ECC counts are compared with the previous reading."""

  def __init__(self, gpus=None, disks=None, memory=None):
    self.gpus, self.disks, self.memory = gpus, disks, memory
    self._ecc = None  # [(uncorrected, corrected)] of the previous reading
    self._readings = None  # this reading's [Gpu]

  @classmethod
  def of_host(cls, tier_dirs: dict[str, str], local_hardware_ids: list[int], on_gpu: bool):
    """This host's readers: NVML on GPUs (when there), the tiers' disks, /proc/meminfo."""
    return cls(nvml_reader(local_hardware_ids) if on_gpu else None, disk_reader(tier_dirs),
               memory_reader())

  def read(self) -> dict:
    """{"risk_PART": value or None, ..., "why_PART": what it saw} for this process."""
    out = {}
    for part, fn in (("ecc", self._ecc_part), ("thermal", self._thermal), ("disk", self._disk),
                     ("memory", self._memory)):
      try:
        value, why = fn()
      except Exception as e:  # a reader that fails this time: absent, the run goes on
        value, why = None, f"unreadable: {type(e).__name__}"
      out[f"risk_{part}"], out[f"why_{part}"] = value, why
    return out

  def _ecc_part(self):
    self._readings = None  # the thermal part reads the same GPU reading
    self._readings = self.gpus() if self.gpus is not None else None
    if self._readings is None:
      return None, "no NVML"
    counts = [(g.uncorrected, g.corrected) for g in self._readings]
    before, self._ecc = self._ecc, counts
    if all(u is None and c is None for u, c in counts):
      return None, "ECC off"
    if before is None:
      return 0.0, "first reading"
    new_u = sum((u or 0) - (b or 0) for (u, _), (b, _) in zip(counts, before))
    new_c = sum((c or 0) - (b or 0) for (_, c), (_, b) in zip(counts, before))
    if new_u > 0:
      return 1.0, f"{new_u} new uncorrected ECC errors"
    return min(1.0, max(0, new_c) / ECC_CORRECTED), f"{max(0, new_c)} new corrected ECC errors"

  def _thermal(self):
    if self._readings is None:
      return None, "no NVML"
    if all(g.throttle is None and g.temperature is None for g in self._readings):
      return None, "not supported"
    worst, why = 0.0, "cool"
    for i, g in enumerate(self._readings):
      named = [name for bit, name in THROTTLE.items() if (g.throttle or 0) & bit]
      if named:
        return 1.0, f"GPU {i}: {', '.join(named)}"
      if g.temperature is not None:
        part = min(1.0, max(0.0, (g.temperature - TEMP_OK) / (TEMP_HOT - TEMP_OK)))
        if part >= worst:
          worst, why = part, f"GPU {i} at {g.temperature:.0f} C"
    return worst, why

  def _disk(self):
    if self.disks is None:
      return None, "not read"
    worst, why = 0.0, "no local tier"
    for tier, (free, total) in self.disks().items():
      part = _scale(free / total)
      if part >= worst:
        worst, why = part, f"{tier} tier: {free / 2**30:.1f} GiB free ({free / total:.1%})"
    return worst, why

  def _memory(self):
    if self.memory is None:
      return None, "no /proc/meminfo"
    available, total = self.memory()
    return _scale(available / total), f"host memory {available / total:.1%} available"


def combine(readings: list[dict]) -> dict:
  """The run's row from every process's reading: each part's largest value (absent when no process
  measured it), `risk` the largest part, `why` what raised it."""
  row, risk, why = {}, 0.0, "nothing"
  for part in PARTS:
    values = [(r[f"risk_{part}"], i, r[f"why_{part}"]) for i, r in enumerate(readings)
              if r[f"risk_{part}"] is not None]
    if not values:
      row[f"risk_{part}"] = None
      continue
    value, process, seen = max(values, key=lambda v: v[0])
    row[f"risk_{part}"] = value
    if value > risk:
      where = f"process {process}: " if len(readings) > 1 else ""
      risk, why = value, f"{part} {value:.2f} ({where}{seen})"
  return {"risk": risk, **row, "why": why}


def read_run(health: Health, gather: Callable[[str, str], list[str]]) -> dict:
  """This process's reading, combined with every other process's (`gather`: peers.gather)."""
  return combine([json.loads(r) for r in gather("hardware", json.dumps(health.read()))])
