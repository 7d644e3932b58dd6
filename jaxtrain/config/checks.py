"""The config's checks: `validate(cfg, device_count)` runs before anything is compiled and raises `ConfigError`
with one line for a config that cannot run; `incompatible` lists what a resumed run may not change."""

import math

from jaxtrain.config.schema import (
    ADVANTAGE_SCALES, ATTENTION, AUTO, AUTO_KEYS, BAD_UTF8, COMM_FORMATS, COMM_KERNELS, CROSS_ENTROPY, ConfigError,
    DATA_AXES, DATA_FORMATS, DATA_KINDS, DISPATCH, DTYPES, ERROR_FEEDBACK, FP8, FUSED_NORM, GROUPED_MATMUL,
    ON_DIVERGENCE, OPTIMIZERS, PACKINGS, PREFERENCE_LOSSES, PRESETS, REMAT, RL_AGGREGATES, ROPE_SCALINGS, ROUTERS,
    SCHEDULES, TASKS, default_config, mesh_shape)


def _check_choice(name, value, choices):
  if value not in choices:
    raise ConfigError(f"{name}: unknown value {value!r}; choose one of {', '.join(choices)}")


def validate(cfg, device_count: int) -> dict[str, int]:
  """Raises ConfigError (one line) for a config that cannot run; returns the mesh shape."""
  m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
  _check_choice("mesh.rules", cfg.mesh.rules, PRESETS)
  _check_choice("model.remat", m.remat, REMAT)
  _check_choice("model.param_dtype", m.param_dtype, DTYPES)
  _check_choice("model.compute_dtype", m.compute_dtype, DTYPES)
  _check_choice("optim.name", o.name, OPTIMIZERS)
  _check_choice("optim.schedule", o.schedule, SCHEDULES)
  _check_choice("data.kind", d.kind, DATA_KINDS)
  _check_choice("data.format", d.format, DATA_FORMATS)
  _check_choice("data.packing", d.packing, PACKINGS)
  _check_choice("data.bad_utf8", d.bad_utf8, BAD_UTF8)
  _check_choice("model.router", m.router, ROUTERS)
  _check_choice("model.dispatch", m.dispatch, DISPATCH)
  _check_choice("model.grouped_matmul", m.grouped_matmul, GROUPED_MATMUL)
  _check_choice("train.cross_entropy", t.cross_entropy, CROSS_ENTROPY)
  _check_choice("model.fused_norm", m.fused_norm, FUSED_NORM)
  _check_choice("model.attention", m.attention, ATTENTION)
  _check_choice("model.fp8", m.fp8, FP8)
  _validate_posttrain(cfg)
  shape = mesh_shape(cfg.mesh, device_count)
  for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "max_seq_len", "attention_block"):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}")
  for key in ("steps", "batch_size", "seq_len", "microbatches", "log_every", "peer_timeout_s", "ce_token_chunk",
              "ce_vocab_chunk"):
    if t[key] == AUTO and f"train.{key}" in AUTO_KEYS:
      continue
    if isinstance(t[key], str) or t[key] <= 0:
      raise ConfigError(f"train.{key} must be positive{' or auto' if f'train.{key}' in AUTO_KEYS else ''}, "
                        f"got {t[key]!r}")
  if t.gpu_hour_price < 0:
    raise ConfigError(f"train.gpu_hour_price must be >= 0 (0 = no cost estimate), got {t.gpu_hour_price}")
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
  tp = shape["tensor"]
  for key in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
    if m[key] % tp:
      raise ConfigError(f"model.{key}={m[key]} is not divisible by the tensor axis ({tp})")
  if cfg.mesh.rules != "dp" and m.d_model % shape["fsdp"]:
    raise ConfigError(f"model.d_model={m.d_model} is not divisible by the fsdp axis ({shape['fsdp']})")
  if t.seq_len > m.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}")
  data_ways = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"]
  if AUTO not in (t.batch_size, t.microbatches) and t.batch_size % (data_ways * t.microbatches):
    raise ConfigError(
        f"train.batch_size={t.batch_size} does not divide into {t.microbatches} microbatch(es) "
        f"over the {data_ways} data-parallel devices (replica*data*fsdp*expert)")
  _validate_context(cfg, shape)
  if d.kind == "synthetic" and d.symbols + 4 > m.vocab_size:
    raise ConfigError(f"data.symbols={d.symbols} needs model.vocab_size >= {d.symbols + 4}")
  if d.kind == "synthetic" and not 0 < d.stop_prob < 1:
    raise ConfigError(f"data.stop_prob must be in (0, 1), got {d.stop_prob}")
  if d.kind == "synthetic" and not 1 <= d.max_symbols <= d.symbols:
    raise ConfigError(f"data.max_symbols must be in [1, data.symbols], got {d.max_symbols}")
  if d.kind == "bytes" and m.vocab_size < 258:
    raise ConfigError(f"data.kind='bytes' needs model.vocab_size >= 258, got {m.vocab_size}")
  if d.kind in ("bytes", "text") and not d.path and t.task == "lm":
    raise ConfigError(f"data.path is empty; data.kind={d.kind!r} needs a file, directory or glob")
  if d.kind == "text" and d.tokenizer == "byte" and m.vocab_size < 258:
    raise ConfigError(f"data.tokenizer='byte' needs model.vocab_size >= 258, got {m.vocab_size}")
  if d.kind == "text" and d.tokenizer == "bpe" and m.vocab_size < d.bpe_vocab_size:
    raise ConfigError(f"model.vocab_size={m.vocab_size} is below data.bpe_vocab_size={d.bpe_vocab_size}")
  if m.n_experts:
    _validate_moe(m, shape, cfg.mesh.rules)
  axis = manual_axis(cfg)
  if m.n_experts and axis and math.prod(shape[a] for a in DATA_AXES if a != axis) > 1:
    raise ConfigError(f"an explicit reduction over {axis} (compression, DiLoCo, optim.reduce_axis) with experts "
                      f"needs the other data axes at size 1: the experts' shard_map cannot nest in the step's yet "
                      f"(set --config.mesh.{axis}={math.prod(shape[a] for a in DATA_AXES)})")
  validate_rope(m)
  _validate_checkpoint(cfg.checkpoint)
  _validate_floats(cfg)
  _validate_optim(o)
  _validate_comm(cfg.comm, cfg.diloco, o, m, shape)
  if o.warmup_steps >= t.steps and t.steps > 1:
    raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be below train.steps={t.steps}: add "
                      f"--config.optim.warmup_steps={max(t.steps // 10, 0)}")
  return shape


# (low, high, whether low itself is allowed) for float settings; high is inclusive unless math.inf.
FLOAT_RANGES = {
    "model.rope_theta": (0.0, math.inf, False), "model.norm_eps": (0.0, 1.0, False),
    "model.init_std": (0.0, math.inf, False), "model.route_scale": (0.0, math.inf, False),
    "optim.lr": (0.0, math.inf, False), "optim.b1": (0.0, 1.0, True), "optim.b2": (0.0, 1.0, True),
    "optim.eps": (0.0, math.inf, False), "optim.weight_decay": (0.0, math.inf, True),
    "optim.grad_clip": (0.0, math.inf, True), "optim.min_lr_ratio": (0.0, 1.0, True),
    "optim.decay_fraction": (0.0, 1.0, True), "train.z_loss": (0.0, math.inf, True),
    "train.device_memory_gib": (0.0, math.inf, True),
    "data.eval_fraction": (0.0, 1.0, True), "sample.temperature": (0.0, math.inf, True),
    "diloco.outer_lr": (0.0, math.inf, False), "diloco.outer_momentum": (0.0, 1.0, True),
    "diloco.mix": (0.0, 1.0, True), "diloco.drop_prob": (0.0, 1.0, True),
    "posttrain.eval_fraction": (0.0, 1.0, False), "posttrain.beta": (0.0, math.inf, False),
    "posttrain.label_smoothing": (0.0, 0.5, True), "posttrain.simpo_gamma": (0.0, math.inf, True),
    "posttrain.rm_center": (0.0, math.inf, True),
    "posttrain.temperature": (0.0, math.inf, False), "posttrain.top_p": (0.0, 1.0, False),
    "posttrain.clip_eps": (0.0, math.inf, False), "posttrain.kl_coef": (0.0, math.inf, True),
    "posttrain.gamma": (0.0, 1.0, True), "posttrain.lam": (0.0, 1.0, True),
    "posttrain.value_coef": (0.0, math.inf, True), "posttrain.value_clip": (0.0, math.inf, True),
}


def _validate_posttrain(cfg):
  """train.task and the posttrain section (paths are read, and their errors reported, by the task)."""
  t, p = cfg.train, cfg.posttrain
  _check_choice("train.task", t.task, TASKS)
  _check_choice("posttrain.loss", p.loss, PREFERENCE_LOSSES)
  for key in ("prompt_field", "completion_field", "messages_field", "chosen_field", "rejected_field"):
    if not p[key]:
      raise ConfigError(f"posttrain.{key} must name a JSONL field, got ''")
  if p.synthetic_examples < 10:
    raise ConfigError(f"posttrain.synthetic_examples={p.synthetic_examples} must be >= 10")
  _check_choice("posttrain.aggregate", p.aggregate, RL_AGGREGATES)
  _check_choice("posttrain.advantage_scale", p.advantage_scale, ADVANTAGE_SCALES)
  if t.task in ("grpo", "ppo"):
    if p.group_size < (2 if t.task == "grpo" else 1) or p.max_new_tokens < 1 or p.top_k < 0:
      raise ConfigError(f"posttrain: group_size={p.group_size} (grpo: >= 2, ppo: >= 1), max_new_tokens="
                        f"{p.max_new_tokens} (>= 1) and top_k={p.top_k} (>= 0) out of range")
    if t.seq_len - p.max_new_tokens < 2:
      raise ConfigError(f"train.seq_len={t.seq_len} leaves fewer than 2 prompt slots before posttrain.max_new_tokens="
                        f"{p.max_new_tokens}")
    if t.eval_every:
      raise ConfigError(f"train.task={t.task!r}: set train.eval_every=0 (the reward and accuracy of every step's "
                        "rollouts are logged instead)")
  if t.task != "lm" and cfg.mesh.context != 1:
    raise ConfigError(f"train.task={t.task!r} with the context axis ({cfg.mesh.context}): post-training batches "
                      "are not permuted for context parallelism yet (set --config.mesh.context=1)")


def _validate_floats(cfg):
  """Every float setting is finite (nan and inf are refused everywhere) and within its range."""
  for key, value in flat(cfg.to_dict()).items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{key} must be a finite number, got {value}")
    if key in FLOAT_RANGES:
      low, high, low_ok = FLOAT_RANGES[key]
      if value < low or (value == low and not low_ok) or value > high:
        interval = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise ConfigError(f"{key} must be in {interval}, got {value}")


def _validate_optim(o):
  _check_choice("optim.on_divergence", o.on_divergence, ON_DIVERGENCE)
  if o.max_consecutive_skips < 1 or o.max_rollbacks < 0:
    raise ConfigError("optim.max_consecutive_skips must be >= 1 and optim.max_rollbacks >= 0")
  if o.reduce_axis not in ("", "replica", "data"):
    raise ConfigError(f"optim.reduce_axis: unknown value {o.reduce_axis!r}; choose '' (implicit), replica or data")


def compressing(cm) -> bool:
  """Whether the `comm` section makes the gradient reduction over comm.axis anything but plain float32
  data parallelism."""
  return cm.format != "f32" or cm.error_feedback != "none"


def per_replica_state(cfg) -> bool:
  """Whether the optimizer keeps one copy of some state per shard of comm.axis (DiLoCo, error feedback)."""
  return bool(cfg.diloco.inner_steps) or cfg.comm.error_feedback != "none"


def manual_axis(cfg) -> str:
  """The mesh axis the train step runs manual over ("" = none): comm.axis when compressing or running
  DiLoCo, else optim.reduce_axis."""
  return cfg.comm.axis if compressing(cfg.comm) or cfg.diloco.inner_steps else cfg.optim.reduce_axis


def _validate_comm(cm, dl, o, m, shape):
  _check_choice("comm.axis", cm.axis, ("replica", "data"))
  _check_choice("comm.format", cm.format, COMM_FORMATS)
  _check_choice("comm.error_feedback", cm.error_feedback, ERROR_FEEDBACK)
  _check_choice("comm.kernel", cm.kernel, COMM_KERNELS)
  _check_choice("diloco.format", dl.format, COMM_FORMATS)
  if cm.block < 2 or cm.block % 2:
    raise ConfigError(f"comm.block={cm.block} must be a positive even number (int4 packs two values per byte)")
  on = compressing(cm) or dl.inner_steps
  if on and shape[cm.axis] < 2:
    raise ConfigError(f"comm: the {cm.axis} axis has size {shape[cm.axis]}; compression and DiLoCo need at least 2 "
                      f"(set --config.mesh.{cm.axis}=N)")
  if on and o.reduce_axis and o.reduce_axis != cm.axis:
    raise ConfigError(f"optim.reduce_axis={o.reduce_axis!r} differs from comm.axis={cm.axis!r}")
  if dl.inner_steps < 0:
    raise ConfigError(f"diloco.inner_steps must be >= 0 (0 = off), got {dl.inner_steps}")
  if not dl.inner_steps:
    return
  if compressing(cm):
    raise ConfigError("comm.format/comm.error_feedback compress per-step gradients, which DiLoCo does not send: "
                      "set diloco.format instead")
  if not 1 <= dl.fragments <= m.n_layers:
    raise ConfigError(f"diloco.fragments={dl.fragments} must be in [1, model.n_layers={m.n_layers}]")
  if dl.inner_steps % dl.fragments:
    raise ConfigError(f"diloco.fragments={dl.fragments} must divide diloco.inner_steps={dl.inner_steps}")
  if not 0 <= dl.delay < dl.inner_steps:
    raise ConfigError(f"diloco.delay={dl.delay} must be in [0, diloco.inner_steps={dl.inner_steps})")


def _validate_context(cfg, shape):
  """Context parallelism cuts each row into 2 x context chunks (causal load balance, Llama 3)."""
  cp, t = shape["context"], cfg.train
  if cp == 1:
    return
  if t.seq_len % (2 * cp):
    raise ConfigError(f"train.seq_len={t.seq_len} does not divide into 2 x {cp} chunks for the context axis ({cp}); "
                      f"use a multiple of {2 * cp}")
  if cfg.model.n_experts:
    raise ConfigError(f"the context axis ({cp}) with experts: the experts' shard_map does not split the sequence "
                      f"yet (set --config.mesh.context=1)")
  if manual_axis(cfg):
    raise ConfigError(f"the context axis ({cp}) with an explicit reduction over {manual_axis(cfg)} (compression, "
                      f"DiLoCo, optim.reduce_axis): not supported yet (set --config.mesh.context=1)")


def _validate_checkpoint(k):
  for key in ("every_steps", "keep_every_steps", "fast_every_steps"):
    if k[key] < 0:
      raise ConfigError(f"checkpoint.{key} must be >= 0, got {k[key]}")
  if k.every_seconds < 0 or k.fast_every_seconds < 0:
    raise ConfigError("checkpoint.every_seconds and checkpoint.fast_every_seconds must be >= 0")
  if k.max_failed_saves < 1:
    raise ConfigError(f"checkpoint.max_failed_saves must be >= 1, got {k.max_failed_saves}")
  if k.keep < 1 or k.fast_keep < 1:
    raise ConfigError(f"checkpoint.keep and checkpoint.fast_keep must be >= 1, got {k.keep} and {k.fast_keep}")
  if k.adaptive and not 1 <= k.adaptive_min_steps <= k.adaptive_max_steps:
    raise ConfigError(f"checkpoint.adaptive_min_steps={k.adaptive_min_steps} must be in [1, "
                      f"checkpoint.adaptive_max_steps={k.adaptive_max_steps}]")
  if k.adaptive and k.adaptive_spike <= 0:
    raise ConfigError(f"checkpoint.adaptive_spike must be positive, got {k.adaptive_spike}")
  if k.fast_dir and not (k.fast_every_steps or k.fast_every_seconds or k.adaptive):
    raise ConfigError("checkpoint.fast_dir is set but nothing saves to it: set checkpoint.fast_every_steps, "
                      "fast_every_seconds or adaptive")


def _validate_moe(m, shape, rules):
  if m.n_experts < 0 or not 1 <= m.top_k <= m.n_experts:
    raise ConfigError(f"model.top_k={m.top_k} must be in [1, model.n_experts={m.n_experts}]")
  if not 0 <= m.moe_first_dense < m.n_layers:
    raise ConfigError(f"model.moe_first_dense={m.moe_first_dense} must be in [0, model.n_layers={m.n_layers})")
  if m.moe_every < 1 or (m.n_layers - m.moe_first_dense) % m.moe_every:
    raise ConfigError(f"model.moe_every={m.moe_every} does not divide the {m.n_layers - m.moe_first_dense} "
                      "layers after model.moe_first_dense")
  if m.capacity_factor <= 0 or m.bias_update_rate < 0 or m.aux_loss_weight < 0 or m.router_z_weight < 0:
    raise ConfigError("model.capacity_factor must be positive; bias_update_rate, aux_loss_weight and "
                      "router_z_weight must be >= 0")
  if m.d_ff_expert < 0 or m.n_shared_experts < 0:
    raise ConfigError("model.d_ff_expert and model.n_shared_experts must be >= 0")
  if rules.endswith("_ep") and m.n_experts % shape["expert"]:
    raise ConfigError(f"model.n_experts={m.n_experts} is not divisible by the expert axis ({shape['expert']})")
  if "tp" in rules and (m.d_ff_expert or m.d_ff) % shape["tensor"]:
    raise ConfigError(f"the expert hidden size is not divisible by the tensor axis ({shape['tensor']})")


def validate_rope(m) -> None:
  """ConfigError (one line) unless the model section's (or a ModelConfig's) rope scaling can be computed."""
  _check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
  if m.rope_scaling == "none":
    return
  if not m.rope_factor > 0:
    raise ConfigError(f"model.rope_factor must be positive with rope_scaling={m.rope_scaling!r}, got {m.rope_factor}")
  if m.rope_scaling in ("llama3", "yarn") and m.rope_original_max_len <= 0:
    raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} needs model.rope_original_max_len (the pre-training "
                      f"context) > 0, got {m.rope_original_max_len}")
  if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
    raise ConfigError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} and rope_high_freq_factor="
                      f"{m.rope_high_freq_factor} must satisfy 0 < low < high")
  if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow < m.rope_beta_fast:
    raise ConfigError(f"model.rope_beta_slow={m.rope_beta_slow} and rope_beta_fast={m.rope_beta_fast} must "
                      "satisfy 0 < slow < fast")
  if m.rope_attention_factor < 0:
    raise ConfigError(f"model.rope_attention_factor must be >= 0 (0 = derived), got {m.rope_attention_factor}")


# Keys a resumed run may change: where and how often it runs, logs and saves, not what it computes.
RESUMABLE_CHANGES = ("mesh.", "checkpoint.", "sample.", "train.steps", "train.log_every", "train.eval_every",
                     "optim.max_consecutive_skips", "optim.on_divergence", "optim.max_rollbacks",
                     "train.eval_batches", "train.microbatches", "data.prefetch", "data.prepare_workers",
                     "data.cache_dir", "train.peer_timeout_s", "train.gpu_hour_price",
                     "train.device_memory_gib")


def flat(d: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for k, v in d.items():
    out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def incompatible(saved: dict, current: dict) -> list[str]:
  """The `key: saved -> current` differences that forbid resuming a run saved with `saved`.

  A key the saved config lacks (added to the schema since) reads as its default: the run was made with it."""
  defaults = flat(default_config().to_dict())
  a, b = {**defaults, **flat(saved)}, flat(current)
  return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and not any(k == r or (r.endswith(".") and k.startswith(r))
                                               for r in RESUMABLE_CHANGES)]
