"""What the planner knows of each device kind: memory, dense peak FLOP/s, link bandwidth, and the
share of peak a training step reaches (a stated assumption, not a measurement, except on CPU: see
EFFICIENCY).

Peak FLOP/s come from `metrics.PEAK_FLOPS` (vendor datasheets, dense); on CPU from the matmul probe
`metrics.peak_flops` (the whole host: virtual CPU devices share its cores)."""

import dataclasses

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Device:
  kind: str
  memory_bytes: float  # per device
  peak_key: str  # the row of metrics.PEAK_FLOPS ("" = measured by the CPU probe)
  link_bytes_s: float  # per device, one direction, within a node / slice (NVLink, ICI)
  slow_link_bytes_s: float  # per device across the replica axis (InfiniBand / data-centre network)


# Bandwidths: NVLink 4 (H100/H200) 900 GB/s and NVLink 3 (A100) 600 GB/s both directions; TPU v5p
# ICI 4,800 Gbit/s per chip, v5e 1,600 and v6e 3,200 (a direction: half); 400 Gbit/s InfiniBand
# per GPU, 200 Gbit/s DCN per v5p chip, 100 per v5e/v6e chip. Memory: v5p 95 GiB HBM, v5e 16,
# v6e 32. CPU: virtual devices copy through host memory (an assumed 10 GB/s each on a shared
# 2-core host).
DEVICES = {
    "h100": Device("h100", 80 * GIB, "H100", 450e9, 50e9),
    "h200": Device("h200", 143771 * 2**20, "H200", 450e9, 50e9),  # as our H200's driver reports
    "a100": Device("a100", 80 * GIB, "A100", 300e9, 25e9),
    # v5e before v5p: detect() matches device kinds in this order ("TPU v5 lite", "TPU v5")
    "tpu-v5e": Device("tpu-v5e", 16 * GIB, "TPU v5 lite", 200e9, 12.5e9),
    "tpu-v5p": Device("tpu-v5p", 95 * GIB, "TPU v5", 600e9, 25e9),
    "tpu-v6e": Device("tpu-v6e", 32 * GIB, "TPU v6", 400e9, 12.5e9),
    # memory: the host's RAM shared by its devices (memory_bytes)
    "cpu": Device("cpu", 0, "", 10e9, 10e9),
}
KINDS = tuple(DEVICES)

# Share of dense peak a train step reaches. Accelerators: 0.4, the model FLOPs utilization
# well-tuned dense LLM runs report (PaLM 46%, Llama 3 38-43%), an assumption until measured there.
# CPU: against the matmul probe metrics.peak_flops (the fastest of 7 runs of a 2048^3 float32
# matmul, the loop's MFU denominator), the fastest of several steps against a probe taken beside
# them (benchmarks/RESULTS.md, "Planner"). The share depends on the host more than on the device
# count: configs/tiny.py on 8 virtual devices and configs/small_20m.py on one reached 0.35-0.39 and
# 0.31-0.39 on one 2-core development host, 0.41-0.50 and 0.40-0.48 on another, and CI's host ran
# small_20m at 0.48. 0.4 is the middle of that spread (within 25% of every run on all three hosts).
EFFICIENCY = {"h100": 0.4, "h200": 0.4, "a100": 0.4, "tpu-v5p": 0.4, "tpu-v5e": 0.4, "tpu-v6e": 0.4,
              "cpu": 0.4}


def memory_bytes(kind: str, n_devices: int) -> float:
  """Per-device memory of `kind`; CPU devices (virtual ones included) share the host's RAM."""
  if kind != "cpu":
    return DEVICES[kind].memory_bytes
  import os
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(n_devices, 1)


def detect() -> str:
  """The device kind of the local default device (one of KINDS; anything unknown plans as cpu)."""
  import jax
  name = jax.local_devices()[0].device_kind.lower()
  for kind, device in DEVICES.items():
    if device.peak_key and device.peak_key.lower() in name:
      return kind
  return "cpu"


def peak_flops(kind: str, dtype_name: str) -> tuple[float, str]:
  """(peak FLOP/s of one device, where it came from). On CPU:
  metrics.peak_flops's probe of the whole host."""
  from jaxtrain import metrics
  device = DEVICES[kind]
  if device.peak_key:
    return metrics.PEAK_FLOPS[device.peak_key][dtype_name], f"table:{device.peak_key}"
  return metrics.peak_flops(dtype_name)
