"""`predict(cfg, n_devices, device_kind)`: per-device memory and step time of a config's train step
on a mesh of any size, before any run and without compiling anything or needing the devices (see
docs/ARCHITECTURE.md, "Planner"). Memory: the state's shards from its logical annotations (exact),
gradients, activations under the remat policy, attention and loss temporaries
(jaxtrain/plan/activations.py). Step time: the step's FLOPs against the device's peak at a stated
efficiency, plus the bytes its collectives send against the link bandwidth, not overlapped
(jaxtrain/plan/devices.py)."""

import copy
import dataclasses

from jaxtrain import config as config_lib, metrics, wire
from jaxtrain.config import ModelConfig
from jaxtrain.model.attention import CPU_BLOCKWISE_FROM, IN_ORDER_ONLY
from jaxtrain.model.transformer import active_mlp_params
from jaxtrain.plan import activations as act, devices as devices_lib, pipeline
from jaxtrain.plan.state_bytes import state_bytes

MEMORY_KEYS = ("params", "opt_state", "batch", "grads", "activations", "attention_temps",
               "loss_temps", "optimizer_temps", "total")
# the backward phase; its peak or the update's
BACKWARD = ("grads", "activations", "attention_temps", "loss_temps")
BACKENDS = {"h100": "gpu", "h200": "gpu", "a100": "gpu", "tpu-v5p": "tpu", "tpu-v5e": "tpu",
            "tpu-v6e": "tpu", "cpu": "cpu"}


@dataclasses.dataclass
class Plan:
  """What one optimizer step of a config needs per device and how long it takes (a prediction)."""
  device_kind: str
  n_devices: int
  mesh: dict
  batch_size: int
  microbatches: int
  n_params: int
  memory: dict  # per-device bytes by MEMORY_KEYS
  device_memory_bytes: float
  fits: bool
  flops_per_step: float  # the whole step, all devices (6N + attention, remat recompute included)
  peak_flops: float  # per device (CPU: the host, which its virtual devices share)
  peak_source: str
  efficiency: float
  compute_time_s: float
  comm_bytes: float  # sent per device per step
  comm_time_s: float
  step_time_s: float
  tokens_per_step: int
  suggestions: list = dataclasses.field(default_factory=list)
  moe: bool = False
  remat: str = "none"
  host_bytes: int = 0  # per device, kept in host memory by train.offload

  def table(self) -> str:
    return format_table(self)


def _attention_impl(m: ModelConfig, seq_len: int, kind: str, context: int = 1,
                    stages: int = 1) -> str:
  """The implementation model.attention resolves to on that kind of device
  (model/attention.choose): context parallelism's load-balanced order is no causal order by
  position (neither cuDNN nor splash), and splash does not run inside a pipeline stage. On a GPU
  `auto` is cuDNN for bf16 rows in order, else the Pallas flash kernel (the LM task packs its rows,
  which cuDNN cannot mask, but both hold a block of scores, not [L, S])."""
  backend = BACKENDS[kind]
  name = m.attention
  if name == "auto":
    half = m.compute_dtype in ("bfloat16", "float16")
    gpu = "cudnn" if half and context == 1 else "pallas"
    name = {"tpu": "splash", "gpu": gpu}.get(backend, "")
    name = name or ("xla" if seq_len < CPU_BLOCKWISE_FROM else "blockwise")
  if (name in IN_ORDER_ONLY and context > 1) or (name == "splash" and stages > 1):
    return "blockwise" if seq_len >= CPU_BLOCKWISE_FROM else "xla"
  return "xla" if name == "xla_causal" else name  # its scores: at most xla's


def memory_bytes(cfg, shape: dict, kind: str) -> tuple[dict, int]:
  """(per-device bytes by MEMORY_KEYS, parameter count) of `cfg` on a mesh of `shape`."""
  m, t = ModelConfig.from_config(cfg.model), cfg.train
  sb = state_bytes(cfg, shape)
  data_ways = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"]
  tokens = act.microbatch_tokens(t.batch_size, t.seq_len, data_ways, shape["context"],
                                 t.microbatches)
  stages, repeats, pipeline_mb = pipeline.schedule(cfg, shape)
  impl = _attention_impl(m, t.seq_len, kind, shape["context"], stages)
  w = act.widths(m, t.seq_len, shape["tensor"], impl, shape["expert"])
  dtype_bytes = 2 if m.compute_dtype == "bfloat16" else 4
  out = {"params": sb["params"], "opt_state": sb["opt_state"] + sb["other"]}
  k = {"cpu": act.XLA_CPU, "tpu": act.XLA_TPU}.get(BACKENDS[kind], act.BY_COUNT)
  out["grads"] = act.grads_bytes(sb["params"], shape["fsdp"] if cfg.mesh.rules != "dp" else 1, m,
                                 t.microbatches, k)
  if stages > 1:
    out.update(pipeline.backward_bytes(m, w, tokens, dtype_bytes, k, stages, repeats, pipeline_mb))
    out["grads"] += sb["params"]  # summed over the iterations, as gradient accumulation does
  else:
    out.update(act.backward_bytes(m, w, tokens, dtype_bytes, k))
  out["loss_temps"] = act.loss_bytes(tokens, m.vocab_size, shape["tensor"], t.cross_entropy,
                                     t.ce_token_chunk, t.ce_vocab_chunk, k)
  out["optimizer_temps"] = act.optimizer_bytes(sb["params"], tokens, m.d_model, k)
  # inputs, targets, segment ids, positions, mask, entropy
  out["batch"] = 24 * tokens * t.microbatches
  out["activations"] = max(out["activations"] - offloaded_activations(cfg, m, tokens, dtype_bytes),
                           0)
  backward = sum(out[k] for k in BACKWARD)
  out["total"] = (out["params"] + out["opt_state"] + out["batch"]
                  + max(backward, out["optimizer_temps"]))
  return {k: int(out[k]) for k in MEMORY_KEYS}, sb["n_params"]


def offloaded_activations(cfg, m: ModelConfig, tokens: int, act_bytes: int) -> int:
  """train.offload=activations: the bytes of the layer inputs remat saves (one [tokens, D] per
  layer), which wait in host memory for the backward pass instead of on the device."""
  return m.n_layers * tokens * m.d_model * act_bytes if cfg.train.offload == "activations" else 0


def host_bytes(cfg, shape: dict) -> int:
  """Per-device bytes train.offload keeps in host memory. The optimizer state or params wait there
  between steps, but XLA:TPU brings them in whole for the step (a device copy as large as them,
  benchmarks/RESULTS.md "Host offload"), so they stay in the device's count."""
  sb, t = state_bytes(cfg, shape), cfg.train
  if t.offload == "activations":
    m = ModelConfig.from_config(cfg.model)
    data_ways = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"]
    tokens = act.microbatch_tokens(t.batch_size, t.seq_len, data_ways, shape["context"],
                                   t.microbatches)
    return offloaded_activations(cfg, m, tokens, 2 if m.compute_dtype == "bfloat16" else 4)
  return {"optimizer": sb["opt_state"], "params": sb["params"]}.get(t.offload, 0)


def flops_per_step(cfg) -> float:
  """Matmul FLOPs of one step (metrics.train_flops_per_token x tokens); remat=full adds a forward
  pass of the layers (dots saves every matmul's output, so recomputes none)."""
  m, t = ModelConfig.from_config(cfg.model), cfg.train
  per_token = metrics.train_flops_per_token(m.n_layers, m.d_model, m.n_heads, m.n_kv_heads,
                                            m.head_dim, m.d_ff, m.vocab_size, t.seq_len,
                                            mlp_params=active_mlp_params(m))
  if m.remat == "full":
    attn_proj = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    per_token += (2 * (m.n_layers * attn_proj + active_mlp_params(m))
                  + m.n_layers * 4 * t.seq_len * m.n_heads * m.head_dim)
  return float(per_token) * t.batch_size * t.seq_len


def comm_bytes(cfg, shape: dict, memory: dict) -> tuple[float, float]:
  """(bytes over the fast links, bytes over the replica axis) each device sends per step, by ring
  collectives: fsdp gathers the params twice and reduce-scatters the gradient per microbatch, the
  other data axes all-reduce the gradient, tensor all-reduces two activations per layer each way."""
  m, t = ModelConfig.from_config(cfg.model), cfg.train
  mb, fs, tp = t.microbatches, shape["fsdp"], shape["tensor"]
  ring = lambda n: (n - 1) / n
  gathered = memory["params"] * fs
  fast = 3 * mb * ring(fs) * gathered if cfg.mesh.rules != "dp" else 0.0
  grads = memory["params"]
  fast += 2 * ring(shape["data"] * shape["expert"] * (fs if cfg.mesh.rules == "dp" else 1)) * grads
  slow = 2 * ring(shape["replica"]) * grads
  if config_lib.compressing(cfg.comm):
    slow *= wire.FORMATS[cfg.comm.format].bits / 32
  data_ways = shape["replica"] * shape["data"] * fs * shape["expert"]
  tokens = t.batch_size * t.seq_len // data_ways // shape["context"]
  dtype_bytes = 2 if m.compute_dtype == "bfloat16" else 4
  fast += 4 * 2 * ring(tp) * tokens * m.d_model * dtype_bytes * m.n_layers
  return fast, slow


def predict(cfg, n_devices: int | None = None, device_kind: str | None = None,
            device_memory_bytes: float | None = None, suggest: bool = True) -> Plan:
  """The Plan of `cfg` on `n_devices` devices of `device_kind` (defaults: this machine's). A bad
  config or mesh is config.ConfigError (one line)."""
  if device_kind is None or n_devices is None:
    import jax
    n_devices = jax.device_count() if n_devices is None else n_devices
    device_kind = devices_lib.detect() if device_kind is None else device_kind
  if device_kind not in devices_lib.DEVICES:
    raise config_lib.ConfigError(
        f"device kind {device_kind!r}: choose one of {', '.join(devices_lib.KINDS)}")
  if n_devices < 1:
    raise config_lib.ConfigError(f"devices must be >= 1, got {n_devices}")
  if config_lib.AUTO in (cfg.train.batch_size, cfg.train.microbatches):
    raise config_lib.ConfigError("predict needs a batch: train.batch_size/microbatches=auto are "
                                 "chosen by jaxtrain.plan.auto.choose (the CLI does so first)")
  shape = config_lib.validate(cfg, n_devices)
  device = devices_lib.DEVICES[device_kind]
  limit = (devices_lib.memory_bytes(device_kind, n_devices) if device_memory_bytes is None
           else device_memory_bytes)
  memory, n_params = memory_bytes(cfg, shape, device_kind)
  flops = flops_per_step(cfg) * pipeline.work(*pipeline.schedule(cfg, shape))  # bubble work
  peak, source = devices_lib.peak_flops(device_kind, cfg.model.compute_dtype)
  eff = devices_lib.EFFICIENCY[device_kind]
  if device_kind == "cpu":  # one host: its virtual devices share the cores the probe measured
    compute = flops / (peak * eff)
  else:
    compute = flops / n_devices / (peak * eff)
  fast, slow = comm_bytes(cfg, shape, memory)
  comm_time = fast / device.link_bytes_s + slow / device.slow_link_bytes_s
  plan = Plan(device_kind, n_devices, shape, cfg.train.batch_size, cfg.train.microbatches,
              n_params, memory, float(limit), memory["total"] <= limit, flops, peak, source, eff,
              compute, fast + slow, comm_time, compute + comm_time,
              cfg.train.batch_size * cfg.train.seq_len, moe=bool(cfg.model.n_experts),
              remat=cfg.model.remat, host_bytes=host_bytes(cfg, shape))
  if suggest and not plan.fits:
    plan.suggestions = suggestions(cfg, n_devices, device_kind, limit)
  return plan


def with_values(cfg, **changes):
  """A copy of `cfg` with dotted keys (written with "__" for ".") set."""
  cfg = copy.deepcopy(cfg)
  for key, value in changes.items():
    section, leaf = key.split("__")
    cfg[section][leaf] = value
  return cfg


def candidates(cfg, n_devices: int) -> list[tuple[str, object]]:
  """Changes that lower memory, one at a time: (description, changed config)."""
  m, t, x = cfg.model, cfg.train, cfg.mesh
  out = [(f"model.remat={r}", with_values(cfg, model__remat=r))
         for r in ("dots", "full") if config_lib.REMAT.index(r) > config_lib.REMAT.index(m.remat)]
  for k in (2, 4, 8, 16):
    out.append((f"train.microbatches={t.microbatches * k}",
                with_values(cfg, train__microbatches=t.microbatches * k)))
  shape = config_lib.mesh_shape(x, n_devices)
  if x.rules != "dp" and shape["data"] > 1:
    changed = with_values(cfg, mesh__fsdp=shape["fsdp"] * shape["data"], mesh__data=1)
    out.append((f"mesh.fsdp={shape['fsdp'] * shape['data']} mesh.data=1", changed))
  if t.cross_entropy == "full":
    out.append(("train.cross_entropy=chunked", with_values(cfg, train__cross_entropy="chunked")))
  if m.attention in ("auto", "xla", "xla_causal"):
    out.append(("model.attention=blockwise", with_values(cfg, model__attention="blockwise")))
  return out


def suggestions(cfg, n_devices: int, device_kind: str, limit: float) -> list[str]:
  """Each single change that makes `cfg` fit, re-predicted: 'change: total (step time)'; the first
  microbatch count that fits only."""
  out, microbatches_done = [], False
  for what, changed in candidates(cfg, n_devices):
    if what.startswith("train.microbatches") and microbatches_done:
      continue
    try:
      plan = predict(changed, n_devices, device_kind, limit, suggest=False)
    except config_lib.ConfigError:
      continue  # the change does not divide the batch or the mesh
    if plan.fits:
      microbatches_done |= what.startswith("train.microbatches")
      out.append(f"{what}: {gib(plan.memory['total'])} per device, {plan.step_time_s:.3g} s/step")
  return out or _stage_suggestions(cfg, n_devices, device_kind, limit) or [
      "no single change fits: add devices (fsdp), or lower train.batch_size or train.seq_len"]


def _stage_suggestions(cfg, n_devices: int, device_kind: str, limit: float) -> list[str]:
  """Pipeline stages, tried when no single other change fits: the fewest that fit, of 2, 4, 8
  (the mesh's -1 axis gives up the devices). Not for MoE: plan/pipeline.py was checked against
  compiles of dense stacks only."""
  if cfg.mesh.stage != 1 or cfg.model.n_experts:
    return []
  for stages in (2, 4, 8):
    try:
      plan = predict(with_values(cfg, mesh__stage=stages), n_devices, device_kind, limit,
                     suggest=False)
    except config_lib.ConfigError:
      continue  # the layers, the batch or the mesh do not divide
    if plan.fits:
      return [f"mesh.stage={stages}: {gib(plan.memory['total'])} per device, "
              f"{plan.step_time_s:.3g} s/step (pipelined, bubble included)"]
  return []


def gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_table(p: Plan) -> str:
  mesh = " ".join(f"{a}={n}" for a, n in p.mesh.items() if n > 1) or "one device"
  rows = [("device", f"{p.n_devices} x {p.device_kind} ({mesh})"),
          ("params", f"{p.n_params:,}"),
          ("batch", f"{p.batch_size} x {p.microbatches} microbatch(es)")]
  phase = ("backward" if sum(p.memory[k] for k in BACKWARD) >= p.memory["optimizer_temps"]
           else "optimizer update")
  rows += [(f"memory.{k}", gib(p.memory[k])) for k in MEMORY_KEYS[:-1]]
  rows += [("memory.total",
            f"{gib(p.memory['total'])} (state + batch + the {phase}, the larger phase)")]
  if p.host_bytes:
    rows += [("host memory", f"{gib(p.host_bytes)} (train.offload)")]
  rows += [("device memory", gib(p.device_memory_bytes)), ("fits", "yes" if p.fits else "NO"),
           ("flops/step", f"{p.flops_per_step:.3g}"),
           ("compute", f"{p.compute_time_s:.3g} s at {p.efficiency:.0%} of {p.peak_flops:.3g} "
                       f"FLOP/s ({p.peak_source})"),
           ("comm", f"{p.comm_bytes / 2**20:,.1f} MiB/device, {p.comm_time_s:.3g} s"),
           ("step time",
            f"{p.step_time_s:.3g} s ({p.tokens_per_step / p.step_time_s:,.0f} tokens/s)")]
  rows += [("would fit with", s) for s in p.suggestions]
  if p.moe and p.remat != "full" and p.device_kind != "cpu":
    rows += [("note", f"MoE under remat {p.remat} is not modelled on accelerators (a step with "
                      "remat none compiled to 1.4x its prediction): check with plan --compiled")]
  if p.mesh.get("context", 1) > 1 and p.device_kind != "cpu":
    rows += [("note", "context parallelism is over-predicted on accelerators (XLA:TPU compiles of "
                      "long_16k and long_32k: 1.07x and 1.24x): check with plan --compiled")]
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
