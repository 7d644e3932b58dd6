"""Accelerators a config can be compiled for on a host that has none: TPU slices through libtpu
(`pip install -e '.[tpu]'`), NVIDIA GPUs through the CUDA plugin (`.[cuda]`), both deviceless.

A target is `KIND:SHAPE`: `tpu-v5p:4x4x4`, `tpu-v5e:16x16`, `tpu-v6e:8x8` (a slice's chip grid, one
device per chip), `h100:8`, `h200:16` (GPUs, 8 a host). `devices(target)` gives its devices, real
`jax.Device`s of that kind that nothing can run on but `jit(...).lower(...).compile()` compiles for:
the compiler, its memory assignment and its cost model are the ones a run on that hardware gets."""

import dataclasses
import math
import os

from jaxtrain.config import ConfigError
from jaxtrain.plan import devices as plan_devices


@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str  # a key of plan.devices.DEVICES
  platform: str  # "tpu" or "gpu"
  jax_name: str  # TPU: get_topology_desc's name prefix; GPU: the device description

  # memory and peak: the planner's table of device kinds (plan/devices.py, metrics.PEAK_FLOPS)
  @property
  def hbm_bytes(self) -> int:
    return int(plan_devices.DEVICES[self.kind].memory_bytes)

  @property
  def usable_bytes(self) -> int:
    """What a jax process may allocate: all of a TPU's HBM; on a GPU the share jax preallocates
    (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set; gpt2_small's batch of 64 compiled here to
    114.8 GiB, under an H200's 140 GiB, and ran out of memory on one)."""
    if self.platform == "tpu":
      return self.hbm_bytes
    return int(self.hbm_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))

  @property
  def bf16_flops(self) -> float:
    from jaxtrain import metrics
    return metrics.PEAK_FLOPS[plan_devices.DEVICES[self.kind].peak_key]["bfloat16"]


CHIPS = {
    "tpu-v5p": Chip("tpu-v5p", "tpu", "v5p"),
    "tpu-v5e": Chip("tpu-v5e", "tpu", "v5e"),
    "tpu-v6e": Chip("tpu-v6e", "tpu", "v6e"),
    "h100": Chip("h100", "gpu", "NVIDIA H100 80GB HBM3"),
    "h200": Chip("h200", "gpu", "NVIDIA H200"),
}
GPUS_PER_HOST = 8
# The asynchronous-collective flags MaxText's GPU and TPU recipes set, passed as compile options.
# XLA:GPU's defaults (jax 0.10.2's CUDA plugin) run an FSDP layer scan's all-gathers and
# reduce-scatters with no matmul beside them; with these the loop is double-buffered and the
# next layer's gathers pipelined behind this layer's matmuls. XLA:TPU (libtpu 0.0.42.1) already
# fuses FSDP's all-gathers into asynchronous collective fusions by default; the flags change
# nothing measured here (benchmarks/RESULTS.md, "Exposed and hidden communication").
ASYNC_FLAGS = {
    "gpu": {"xla_gpu_enable_latency_hiding_scheduler": True,
            "xla_gpu_enable_pipelined_all_gather": True,
            "xla_gpu_enable_pipelined_reduce_scatter": True,
            "xla_gpu_enable_pipelined_all_reduce": True,
            "xla_gpu_enable_while_loop_double_buffering": True},
    "tpu": {"xla_tpu_enable_async_collective_fusion": True,
            "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
            "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
            "xla_tpu_overlap_compute_collective_tc": True,
            "xla_enable_async_all_gather": True,
            "xla_tpu_enable_data_parallel_all_reduce_opt": True,
            "xla_tpu_data_parallel_opt_different_sized_ops": True},
}
EXTRAS = {"tpu": "tpu", "gpu": "cuda"}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # as given: "tpu-v5p:4x4x4"
  kind: str  # a key of CHIPS
  shape: tuple[int, ...]  # TPU: the chip grid; GPU: (count,)

  @property
  def chip(self) -> Chip:
    return CHIPS[self.kind]

  @property
  def platform(self) -> str:
    return self.chip.platform

  @property
  def n_devices(self) -> int:
    return math.prod(self.shape)


def parse(name: str) -> Target:
  """`tpu-v5p:4x4x4` -> Target; a bad name is a ConfigError naming the valid forms."""
  kind, _, shape = name.partition(":")
  forms = "tpu-v5p:4x4x4, tpu-v5e:16x16, tpu-v6e:8x8, h100:8, h200:8"
  if kind not in CHIPS or not shape:
    raise ConfigError(f"--target={name!r}: expected KIND:SHAPE with KIND one of "
                      f"{', '.join(CHIPS)} (e.g. {forms})")
  try:
    dims = tuple(int(d) for d in shape.split("x"))
  except ValueError:
    dims = ()
  if not dims or min(dims) < 1:
    raise ConfigError(f"--target={name!r}: SHAPE is a grid of positive integers (e.g. {forms})")
  if CHIPS[kind].platform == "gpu":
    if len(dims) != 1 or (dims[0] > GPUS_PER_HOST and dims[0] % GPUS_PER_HOST):
      raise ConfigError(f"--target={name!r}: a GPU count, at most {GPUS_PER_HOST} or a multiple "
                        f"of it (e.g. h100:8, h100:16)")
  elif len(dims) not in (2, 3):
    raise ConfigError(f"--target={name!r}: a TPU slice is AxB or AxBxC chips (e.g. {forms})")
  return Target(name, kind, dims)


def _gpu_target_config(chip: Chip) -> str:
  """The GpuTargetConfig (text proto) of a Hopper GPU: what the compiler asks of the device."""
  return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {4800000000000 if 'H200' in chip.jax_name else 3352320000000}
  l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{chip.jax_name}"
"""


def quiet_environment(platform: str) -> None:
  """Variables libtpu and the CUDA plugin read to start without hardware, set unless the user set
  them: without them libtpu prints its search for TPU workers and takes a lock that one process
  at a time may hold (/tmp/libtpu_lockfile: a second compiling process would fail), and the CUDA
  plugin refuses a host without a driver."""
  if platform == "tpu":
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  else:
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def available(platform: str) -> str | None:
  """None if `platform`'s deviceless compiler is installed, else why not (one line)."""
  import importlib.util
  module = {"tpu": "libtpu", "gpu": "jax_plugins.xla_cuda12"}[platform]
  try:
    found = importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    found = False
  if found:
    return None
  return (f"compiling for {platform.upper()} needs {module.split('.')[-1]}: "
          f"pip install -e '.[{EXTRAS[platform]}]' (make test-targets installs it)")


def devices(target: Target) -> list:
  """The target's devices (deviceless: compile only), in the topology's order."""
  why = available(target.platform)
  if why:
    raise ConfigError(why)
  quiet_environment(target.platform)
  from jax.experimental import topologies
  if target.platform == "tpu":
    topology = topologies.get_topology_desc(
        topology_name=f"{target.chip.jax_name}:{'x'.join(map(str, target.shape))}",
        platform="tpu")
  else:
    n = target.shape[0]
    hosts, per_host = (1, n) if n <= GPUS_PER_HOST else (n // GPUS_PER_HOST, GPUS_PER_HOST)
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=_gpu_target_config(target.chip),
        topology=f"1x{hosts}x{per_host}")
  return list(topology.devices)
