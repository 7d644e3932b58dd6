"""The config schema: every key, its default and its checks. No jax import here.

A config file in `configs/` starts from `default_config()` and changes values. `validate(cfg,
device_count)` runs before anything is compiled and raises `ConfigError` with one line.
"""

import ml_collections

PRESETS = ("dp", "fsdp", "fsdp_tp", "fsdp_ep", "fsdp_tp_ep")
ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")
GROUPED_MATMUL = ("auto", "tiles", "ragged_dot")
REMAT = ("none", "dots", "full")
SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
DATA_KINDS = ("synthetic", "bytes", "text")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "arrayrecord", "hf")
PACKINGS = ("first_fit", "best_fit")
BAD_UTF8 = ("repair", "skip")
DTYPES = ("float32", "bfloat16")
MESH_AXES = ("replica", "data", "fsdp", "expert", "tensor")


class ConfigError(ValueError):
  """A config value that cannot run; the message is one line for the user."""


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 256
  m.d_model = 128
  m.n_layers = 2
  m.n_heads = 4
  m.n_kv_heads = 4
  m.head_dim = 32
  m.d_ff = 512
  m.max_seq_len = 256
  m.rope_theta = 10000.0
  m.tie_embeddings = True
  m.norm_eps = 1e-6
  m.param_dtype = "float32"
  m.compute_dtype = "float32"
  m.remat = "none"  # one of REMAT
  m.scan_layers = True  # False unrolls the layer loop (same parameter tree); faster on CPU
  m.init_std = 0.02
  # Mixture of experts (jaxtrain/model/moe.py); n_experts = 0 is a dense model.
  m.n_experts = 0  # routed experts per MoE layer
  m.top_k = 2  # experts per token
  m.d_ff_expert = 0  # hidden size of each routed (and shared) expert; 0 = d_ff
  m.n_shared_experts = 0  # experts every token goes through (DeepSeek), SwiGLU of n * d_ff_expert
  m.router = "softmax"  # one of ROUTERS: scores = softmax or sigmoid of the router logits
  m.renormalize = True  # top-k gate weights divided by their sum
  m.route_scale = 1.0  # routed output multiplied by this (DeepSeek-V3: 2.5)
  m.dispatch = "dropless"  # one of DISPATCH: sorted grouped matmul, or capacity buffers that drop
  m.grouped_matmul = "auto"  # dropless, one of GROUPED_MATMUL: auto = ragged_dot on TPU, tiles elsewhere
  m.capacity_factor = 1.25  # capacity: slots per expert = ceil(factor * tokens * top_k / n_experts)
  m.moe_first_dense = 0  # the first n layers keep a dense MLP
  m.moe_every = 1  # after those, every k-th layer is MoE (1 = all)
  m.aux_loss_weight = 0.01  # load-balancing loss (Switch/GShard: E * sum_e f_e * p_e)
  m.router_z_weight = 0.001  # router z-loss (ST-MoE: mean logsumexp(router logits)^2)
  m.bias_update_rate = 0.0  # auxiliary-loss-free balancing (DeepSeek-V3): per-expert bias step; 0 = off

  c.data = d = ml_collections.ConfigDict()
  d.kind = "synthetic"  # one of DATA_KINDS
  d.path = ""  # bytes: a file, directory or glob of text files
  d.symbols = 200  # synthetic: alphabet of the random half
  d.stop_prob = 1 / 16  # synthetic: chance that the random half ends after each symbol
  d.max_symbols = 48  # synthetic: the random half never exceeds this
  d.eval_fraction = 0.05  # bytes, text: share of documents held out
  # text: a prepared corpus through the grain pipeline (jaxtrain/data/pipeline.py)
  d.format = "auto"  # one of DATA_FORMATS; auto picks by file extension
  d.text_field = "text"  # jsonl, parquet, hf: the field or column holding the text
  d.tokenizer = "byte"  # "byte", "bpe" (trained on the corpus by prepare), or a tokenizer.json / .model path
  d.bpe_vocab_size = 1024  # bpe: vocabulary size to train (model.vocab_size must be at least this)
  d.add_bos = True
  d.add_eos = True
  d.cache_dir = ""  # "" = WORKDIR/data_cache
  d.packing = "first_fit"  # one of PACKINGS
  d.bad_utf8 = "repair"  # one of BAD_UTF8: replace invalid bytes with U+FFFD, or skip the document
  d.prepare_workers = 0  # 0 = one per core
  d.prefetch = 2  # batches prepared ahead by a background thread

  c.train = t = ml_collections.ConfigDict()
  t.steps = 600
  t.batch_size = 32
  t.seq_len = 128
  t.seed = 0
  t.microbatches = 1
  t.log_every = 20
  t.eval_every = 200
  t.eval_batches = 4
  t.z_loss = 0.0

  c.optim = o = ml_collections.ConfigDict()
  o.name = "adamw"  # one of OPTIMIZERS
  o.lr = 3e-3
  o.schedule = "cosine"  # one of SCHEDULES
  o.warmup_steps = 50
  o.decay_fraction = 0.2  # wsd: share of steps spent decaying at the end
  o.min_lr_ratio = 0.1
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.grad_clip = 1.0  # global norm; 0 disables
  o.skip_nonfinite = True

  c.mesh = x = ml_collections.ConfigDict()
  x.replica = 1
  x.data = -1
  x.fsdp = 1
  x.expert = 1
  x.tensor = 1
  x.rules = "fsdp"  # one of PRESETS

  c.checkpoint = k = ml_collections.ConfigDict()
  k.every_steps = 0  # persistent tier: save every n steps (0: by seconds / at the end only)
  k.every_seconds = 0.0  # persistent tier: also save when this many seconds passed since its last save
  k.dir = ""  # persistent tier: a path or TensorStore URL (gs://, s3://); "" = WORKDIR/checkpoints
  k.keep = 2  # persistent tier: keep the newest n steps
  k.keep_every_steps = 0  # persistent tier: also keep every step divisible by this (0: none)
  k.fast_dir = ""  # fast tier (local disk, RAM disk); "" = no fast tier
  k.fast_every_steps = 0  # fast tier: save every n steps
  k.fast_every_seconds = 0.0  # fast tier: and/or every this many seconds
  k.fast_keep = 1  # fast tier: keep the newest n steps
  k.max_failed_saves = 3  # end the run (exit status 5) when this many saves of a tier fail in a row
  # Adaptive: between min and max steps apart, sooner while the loss is unstable (see checkpoint/policy.py).
  k.adaptive = False
  k.adaptive_min_steps = 10
  k.adaptive_max_steps = 200
  k.adaptive_spike = 0.1  # a loss above (1 + spike) x its running median is unstable
  k.ocdbt = True  # Orbax's OCDBT key-value store (few files; best on object stores); False: a zarr dir per array
  k.compress = False  # zstd on the arrays: a few % smaller for trained float weights, 2-4x slower on CPU
  k.init_from = ""  # start from the params of another checkpoint (a converted HF model, a run dir)

  c.sample = s = ml_collections.ConfigDict()
  s.prompt = ""
  s.max_new_tokens = 64
  s.temperature = 0.8
  s.top_k = 20
  return c


def mesh_shape(cfg, device_count: int) -> dict[str, int]:
  """Mesh axis sizes with the one -1 filled from the device count."""
  sizes = {a: int(cfg.mesh[a]) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh: only one axis may be -1, got {', '.join(free)}")
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ConfigError(f"mesh: axis sizes must be positive or -1, got {sizes}")
  fixed = 1
  for a, s in sizes.items():
    if s != -1:
      fixed *= s
  if free:
    if device_count % fixed:
      raise ConfigError(
          f"mesh: fixed axes multiply to {fixed}, which does not divide the {device_count} devices")
    sizes[free[0]] = device_count // fixed
  elif fixed != device_count:
    raise ConfigError(f"mesh: axes multiply to {fixed} but there are {device_count} devices")
  return sizes


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
  shape = mesh_shape(cfg, device_count)
  for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "max_seq_len"):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}")
  for key in ("steps", "batch_size", "seq_len", "microbatches", "log_every"):
    if t[key] <= 0:
      raise ConfigError(f"train.{key} must be positive, got {t[key]}")
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
  if t.batch_size % (data_ways * t.microbatches):
    raise ConfigError(
        f"train.batch_size={t.batch_size} does not divide into {t.microbatches} microbatch(es) "
        f"over the {data_ways} data-parallel devices (replica*data*fsdp*expert)")
  if d.kind == "synthetic" and d.symbols + 4 > m.vocab_size:
    raise ConfigError(f"data.symbols={d.symbols} needs model.vocab_size >= {d.symbols + 4}")
  if d.kind == "synthetic" and not 0 < d.stop_prob < 1:
    raise ConfigError(f"data.stop_prob must be in (0, 1), got {d.stop_prob}")
  if d.kind == "synthetic" and not 1 <= d.max_symbols <= d.symbols:
    raise ConfigError(f"data.max_symbols must be in [1, data.symbols], got {d.max_symbols}")
  if d.kind == "bytes" and m.vocab_size < 258:
    raise ConfigError(f"data.kind='bytes' needs model.vocab_size >= 258, got {m.vocab_size}")
  if d.kind in ("bytes", "text") and not d.path:
    raise ConfigError(f"data.path is empty; data.kind={d.kind!r} needs a file, directory or glob")
  if d.kind == "text" and d.tokenizer == "byte" and m.vocab_size < 258:
    raise ConfigError(f"data.tokenizer='byte' needs model.vocab_size >= 258, got {m.vocab_size}")
  if d.kind == "text" and d.tokenizer == "bpe" and m.vocab_size < d.bpe_vocab_size:
    raise ConfigError(f"model.vocab_size={m.vocab_size} is below data.bpe_vocab_size={d.bpe_vocab_size}")
  if m.n_experts:
    _validate_moe(m, shape, cfg.mesh.rules)
  _validate_checkpoint(cfg.checkpoint)
  if o.lr <= 0:
    raise ConfigError(f"optim.lr must be positive, got {o.lr}")
  if o.warmup_steps >= t.steps and t.steps > 1:
    raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be below train.steps={t.steps}")
  return shape


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


# Keys a resumed run may change: where and how often it runs, logs and saves, not what it computes.
RESUMABLE_CHANGES = ("mesh.", "checkpoint.", "sample.", "train.steps", "train.log_every", "train.eval_every",
                     "train.eval_batches", "train.microbatches", "data.prefetch", "data.prepare_workers",
                     "data.cache_dir")


def incompatible(saved: dict, current: dict) -> list[str]:
  """The `key: saved -> current` differences that forbid resuming a run saved with `saved`."""
  def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
      out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
  a, b = flat(saved), flat(current)
  return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and not any(k == r or (r.endswith(".") and k.startswith(r))
                                               for r in RESUMABLE_CHANGES)]


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """`path/to/NAME.py[:ARG]` -> the file's get_config(ARG) (ARG is None when absent)."""
  import importlib.util
  import os
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"--config: no such file {path!r}")
  module_spec = importlib.util.spec_from_file_location(f"_jaxtrain_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config: {path} has no get_config(arg) function")
  return module.get_config(arg or None)


def _parse_value(key: str, text: str, current):
  """`text` as the type of the current value; one-line ConfigError when it does not fit."""
  if isinstance(current, bool):
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ConfigError(f"--config.{key}: expected true or false, got {text!r}")
  for kind in (int, float):
    if isinstance(current, kind):
      try:
        return kind(text) if kind is float else int(text, 0)
      except ValueError:
        raise ConfigError(f"--config.{key}: expected {kind.__name__}, got {text!r}") from None
  return text


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, str]) -> ml_collections.ConfigDict:
  """Sets dotted keys from strings, typed as their defaults; unknown keys are refused."""
  for key, text in overrides.items():
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
      if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
        raise ConfigError(f"--config.{key}: unknown config key")
      node = node[part]
    if leaf not in node or isinstance(node[leaf], ml_collections.ConfigDict):
      raise ConfigError(f"--config.{key}: unknown config key")
    node[leaf] = _parse_value(key, text, node[leaf])
  return cfg
