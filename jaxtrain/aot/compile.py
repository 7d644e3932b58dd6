"""A config's train step compiled for an accelerator this host does not have: the step the loop
would run there (`builder.abstract_step` on the target's devices, traced for its backend), compiled
by that backend's own compiler, and what the compiler says of it.

`compile_for(cfg, "tpu-v5p:4x4x4")` -> `Compiled`: per-device memory (`memory_analysis()`:
argument, output, temp, alias; total = argument + output + temp - alias, the donated state counted
once) against the chip's HBM, matmul FLOPs per device (`matmul_flops`: of the traced step, remat's
recomputation included; `cost_analysis()` counts a scanned layer once), collective bytes by
mesh axis (`parallel.hlo_bytes`, counted in the compiled HLO), what train.offload keeps in and
copies to the host's memory, and the time to lower and compile.
When the compiler refuses the program for want of memory, `fits` is False and `refusal` says what it
needed. Compiled is not executed: nothing here runs a step."""

import contextlib
import dataclasses
import math
import re
import time

import jax
from jax.extend import core as jax_core

from jaxtrain import builder, config as config_lib, metrics, parallel
from jaxtrain.aot import targets as targets_lib
from jaxtrain.kernels import platform
from jaxtrain.model import ModelConfig, active_mlp_params
from jaxtrain.parallel import hlo_bytes, hlo_host

MEMORY_KEYS = ("argument", "output", "temp", "alias", "total")
GIB = 1024**3


@dataclasses.dataclass
class Compiled:
  """What compiling `config` for `target` gave (per device unless a name says otherwise)."""
  target: str
  config: str
  mesh: dict  # axis -> size
  memory: dict  # MEMORY_KEYS -> bytes; {} when the compiler refused the program
  hbm_bytes: int
  usable_bytes: int  # what a jax process may allocate of it (targets.Chip.usable_bytes)
  flops: float  # per device per step: the traced step's matmuls, remat's recomputation included
  model_flops: float  # per device per step: metrics.train_flops_per_token x tokens / devices
  collectives: dict  # "axes dtype" -> bytes one device sends per step
  lower_s: float
  compile_s: float
  refusal: str = ""  # the compiler's own words when it refused the program
  kernels: tuple = ()  # the Pallas kernels the step calls (their FLOPs are not in `flops`)
  ragged_flops: float = 0.0  # per device: dropless MoE's ragged dots at their static size, at most
  # train.offload: bytes in the host's memory ("argument", "temp") and copied per step ("to_host",
  # "to_device"; parallel.hlo_host.host_transfers), per device
  host: dict = dataclasses.field(default_factory=dict)

  @property
  def fits(self) -> bool:
    return not self.refusal and self.memory["total"] <= self.usable_bytes

  def table(self) -> str:
    chip = targets_lib.parse(self.target).chip
    mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one device"
    lines = [f"{self.config} on {self.target}: mesh {mesh}",
             f"lowered in {self.lower_s:.1f} s, compiled in {self.compile_s:.1f} s "
             f"(compiled, not executed)"]
    if self.refusal:
      lines.append(f"does not fit: the compiler refused the program: {self.refusal}")
    else:
      m = self.memory
      lines.append("per-device memory (GiB): " + ", ".join(
          f"{k} {m[k] / GIB:.2f}" for k in MEMORY_KEYS[:-1]))
      verdict = "fits" if self.fits else "does not fit"
      usable = ("" if self.usable_bytes == self.hbm_bytes else
                f" (jax may allocate {self.usable_bytes / GIB:.2f})")
      lines.append(f"  total {m['total'] / GIB:.2f} of {self.hbm_bytes / GIB:.2f} HBM{usable}: "
                   f"{verdict}")
    if any(self.host.values()):
      h = self.host
      lines.append(f"host memory (GiB): argument {h['argument'] / GIB:.2f}, temp "
                   f"{h['temp'] / GIB:.2f}; copied per step: {h['to_host'] / GIB:.3f} to the host, "
                   f"{h['to_device'] / GIB:.3f} to the device")
    if self.flops:
      at_peak = self.flops / chip.bf16_flops
      bound = ("" if self.kernels or self.ragged_flops else
               f", so MFU <= {self.model_flops / self.flops:.0%}")
      lines.append(f"per-device step: {self.flops / 1e12:.2f} TFLOP of matmuls (the model's "
                   f"{self.model_flops / 1e12:.2f}, the rest recomputation): "
                   f"{at_peak * 1e3:.1f} ms at the bf16 peak{bound}")
    if self.ragged_flops:
      lines.append(f"ragged dots (dropless experts; not counted above): at most "
                   f"{self.ragged_flops / 1e12:.2f} TFLOP (their buffers' static size)")
    if self.kernels:
      lines.append(f"Pallas kernels (their FLOPs not counted above): {', '.join(self.kernels)}")
    if self.collectives:
      lines.append("collectives, bytes one device sends per step:")
      for key, value in sorted(self.collectives.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {key:<24} {value / GIB:10.3f} GiB")
    else:
      lines.append("collectives: none")
    return "\n".join(lines)


def _refusal(error: Exception) -> str:
  """The compiler's out-of-memory message in one line, else ''."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "exceeds" not in text.lower():
    return ""
  first = next((line for line in text.splitlines() if line.strip()), text)
  return re.sub(r"\s+", " ", first)[:300]


def compile_for(cfg, target: str, config_name: str = "") -> Compiled:
  """Compiles `cfg`'s train step for `target` (targets.parse's names); see the module docstring.
  `cfg` is validated against the target's device count first (ConfigError on a bad mesh)."""
  spec = targets_lib.parse(target)
  devices = targets_lib.devices(spec)
  config_lib.validate(cfg, len(devices))
  with platform.target(spec.platform):
    start = time.perf_counter()
    train_fn, state, batch, mesh = builder.abstract_step(cfg, devices)
    with parallel.activate(mesh, cfg.mesh.rules):
      traced = train_fn.trace(state, batch)
      lowered = traced.lower()
    flops = matmul_flops(traced.jaxpr.jaxpr) / len(devices)
    ragged_flops = matmul_flops(traced.jaxpr.jaxpr, dot="ragged_dot_general") / len(devices)
    kernels = tuple(sorted(set(kernel_names(traced.jaxpr.jaxpr))))
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    memory, refusal, text, host = {}, "", "", {}
    try:
      compiled = lowered.compile()
    except Exception as e:  # XlaRuntimeError: the compiler's verdict, reported, not raised
      refusal = _refusal(e)
      if not refusal:
        raise
    else:
      stats = compiled.memory_analysis()
      memory = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in MEMORY_KEYS[:-1]}
      memory["total"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
      text = compiled.as_text()
      host = {k: int(getattr(stats, f"host_{k}_size_in_bytes")) for k in ("argument", "temp")}
      host.update(hlo_host.host_transfers(text))
    compile_s = time.perf_counter() - start
  rows = hlo_bytes.collectives(text, mesh) if text else []
  collectives = {f"{axes} {dtype}": b for (axes, dtype), b in hlo_bytes.by_axis(rows).items()}
  return Compiled(target=spec.name, config=config_name, mesh=dict(mesh.shape), memory=memory,
                  hbm_bytes=spec.chip.hbm_bytes, usable_bytes=spec.chip.usable_bytes,
                  flops=flops, model_flops=_model_flops(cfg) / len(devices),
                  collectives=collectives,
                  lower_s=lower_s, compile_s=compile_s, refusal=refusal, kernels=kernels,
                  ragged_flops=ragged_flops, host=host)


def scheduled_hlo(cfg, target: str) -> str:
  """The compiled module (its text, instructions in schedule order: parallel.hlo_schedule) of
  `cfg`'s call of train.steps_per_call steps for `target` (its single step when that is 1), with
  the compiler's defaults."""
  return scheduled(cfg, target, async_flags=False)[0]


def scheduled(cfg, target: str | None = None, devices=None, async_flags: bool = True):
  """(compiled module text, mesh, abstract state, optimizer steps the module runs) of `cfg`'s call
  of train.steps_per_call steps (its single step when that is 1), for `target` (deviceless) or
  else on `devices` (default: this host's). For a target, `async_flags` compiles with the
  asynchronous-collective flags large runs set there (targets.ASYNC_FLAGS)."""
  spec = targets_lib.parse(target) if target else None
  devices = targets_lib.devices(spec) if spec else (devices or jax.devices())
  config_lib.validate(cfg, len(devices))
  k = cfg.train.steps_per_call
  options = targets_lib.ASYNC_FLAGS[spec.platform] if spec and async_flags else {}
  with platform.target(spec.platform) if spec else contextlib.nullcontext():
    fn, state, batch, mesh = builder.abstract_step(cfg, devices, call=k > 1)
    with parallel.activate(mesh, cfg.mesh.rules):
      text = fn.lower(state, batch).compile(compiler_options=options).as_text()
  return text, mesh, state, k


def _model_flops(cfg) -> float:
  """Matmul FLOPs of one step of the whole model (forward + backward, no recomputation)."""
  m = ModelConfig.from_config(cfg.model)
  per_token = metrics.train_flops_per_token(m.n_layers, m.d_model, m.n_heads, m.n_kv_heads,
                                            m.head_dim, m.d_ff, m.vocab_size, cfg.train.seq_len,
                                            active_mlp_params(m))
  return per_token * cfg.train.batch_size * cfg.train.seq_len


def matmul_flops(jaxpr, times: int = 1, dot: str = "dot_general") -> float:
  """FLOPs of the `dot_general`s of a jaxpr (`dot="ragged_dot_general"`: of its ragged dots, MoE's
  dropless experts, at their static size: every row of the buffer, an upper bound), the whole
  mesh's (2 x result elements x contracted size): a scan's body `length` times, a shard_map's
  body once per shard, a cond's costliest branch, a while loop's body once. Pallas kernels count
  nothing (`kernel_names` lists them)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == dot:
      numbers = (eqn.params["dimension_numbers"] if dot == "dot_general" else
                 eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers)
      (contracting, _), _ = numbers
      lhs = eqn.invars[0].aval.shape
      total += (2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracting)
                * times)
    inner = times
    if name == "scan":
      inner *= eqn.params["length"]
    elif name == "shard_map":
      inner *= math.prod(eqn.params["mesh"].shape[a] for a in eqn.params["newly_manual_axes"])
    counts = [matmul_flops(sub, inner, dot) for sub in jax_core.jaxprs_in_params(eqn.params)]
    total += max(counts, default=0.0) if name == "cond" else sum(counts)
  return total


def kernel_names(jaxpr):
  """The names of the Pallas kernels a jaxpr calls, at any depth."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield str(eqn.params.get("name") or eqn.params.get("name_and_src_info") or "pallas_call")
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from kernel_names(sub)
