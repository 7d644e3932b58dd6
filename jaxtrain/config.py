"""The config schema: every key, its default and its checks. No jax import here.

A config file in `configs/` starts from `default_config()` and changes values. `validate(cfg,
device_count)` runs before anything is compiled and raises `ConfigError` with one line.
"""

import dataclasses
import math

import ml_collections

# Logical axis -> mesh axes, one table per preset (`mesh.rules`); only jaxtrain/parallel applies them.
# Every data-like axis splits the batch; `fsdp` also splits parameters, `tensor` never the batch.
# Flax resolves rules in order and skips a mesh axis a dimension already uses, so an activation
# [batch, seq, embed] gets fsdp on batch only, while a [vocab, embed] weight gets it on embed.
DATA_AXES = ("replica", "data", "fsdp", "expert")
# The sequence splits over `context` (context parallelism, jaxtrain/model/context.py). Its rule comes first, so a
# [batch, seq, ...] activation takes `context` on seq and the data axes on batch; an array with a batch but no
# seq (nothing the dense model has today) takes `context` on its batch too.
_SEQ = [("seq", "context")]
# "replica", "data_shards": one copy of a state per shard of that mesh axis (optimizer buffers)
_BATCH = _SEQ + [("batch", DATA_AXES + ("context",)), ("batch", DATA_AXES), ("replica", "replica"),
                 ("data_shards", "data")]
_FSDP = [("embed", "fsdp")]
_EP = [("expert", "expert")]  # experts over the expert axis; tokens travel to them by all-to-all
_TP = [("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]
RULES = {
    "dp": _BATCH,
    "fsdp": _BATCH + _FSDP,
    "fsdp_tp": _BATCH + _FSDP + _TP,
    "fsdp_ep": _BATCH + _EP + _FSDP,
    "fsdp_tp_ep": _BATCH + _EP + _FSDP + _TP,
}
PRESETS = tuple(RULES)
ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")
GROUPED_MATMUL = ("auto", "tiles", "ragged_dot")
REMAT = ("none", "dots", "full")
SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
ON_DIVERGENCE = ("stop", "rollback")
DATA_KINDS = ("synthetic", "bytes", "text")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "arrayrecord", "hf")
PACKINGS = ("first_fit", "best_fit")
BAD_UTF8 = ("repair", "skip")
DTYPES = ("float32", "bfloat16")
COMM_FORMATS = ("f32", "bf16", "fp8", "int8", "int4")
ERROR_FEEDBACK = ("none", "ef", "ef21")
COMM_KERNELS = ("xla", "pallas")  # jaxtrain/optim/compress.py KERNELS
CROSS_ENTROPY = ("full", "chunked", "pallas")  # jaxtrain/kernels/cross_entropy/ops.py IMPLEMENTATIONS
FUSED_NORM = ("off", "xla", "pallas")  # off, or jaxtrain/kernels/rms_norm/ops.py IMPLEMENTATIONS
ATTENTION = ("auto", "xla", "blockwise", "cudnn", "pallas", "splash")
FP8 = ("off", "current")  # jaxtrain/model/fp8.py MODES
# context sits next to tensor: it gathers keys and values every layer, so it wants the fast links
MESH_AXES = ("replica", "data", "fsdp", "expert", "context", "tensor")
# What a run trains (train.task): "lm" pre-training (jaxtrain/train/lm.py); the post-training tasks live in
# jaxtrain/posttrain (their TASKS dict); "grpo" and "ppo" are the RL tasks (rollouts on the training mesh).
TASKS = ("lm", "sft", "rm", "dpo", "grpo", "ppo")
RL_AGGREGATES = ("token", "sequence")  # jaxtrain/posttrain/rl.py AGGREGATES
ADVANTAGE_SCALES = ("std", "none")  # grpo: group advantages / (group std + eps), or centred only (Dr. GRPO)
PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")  # jaxtrain/posttrain/preference.py


# train.batch_size and train.microbatches may be "auto": the planner picks the largest batch (the fewest
# microbatches) that fits train.device_memory_gib, confirmed by a compile (jaxtrain/plan/auto.py)
AUTO = "auto"
AUTO_KEYS = ("train.batch_size", "train.microbatches")


class ConfigError(ValueError):
  """A config value that cannot run; the message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The `model` section: every default written once, here; the model reads this dataclass."""
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 4
  head_dim: int = 32
  d_ff: int = 512
  max_seq_len: int = 256
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  param_dtype: str = "float32"  # one of DTYPES
  compute_dtype: str = "float32"
  remat: str = "none"  # one of REMAT; saves memory with scan_layers (XLA:CPU unrolled: none, with or without CSE)
  scan_layers: bool = True  # False unrolls the layer loop (same parameter tree); faster on CPU
  init_std: float = 0.02
  # Mixture of experts (jaxtrain/model/moe.py); n_experts = 0 is a dense model.
  n_experts: int = 0  # routed experts per MoE layer
  top_k: int = 2  # experts per token
  d_ff_expert: int = 0  # hidden size of each routed (and shared) expert; 0 = d_ff
  n_shared_experts: int = 0  # experts every token goes through (DeepSeek), SwiGLU of n * d_ff_expert
  router: str = "softmax"  # one of ROUTERS: scores = softmax or sigmoid of the router logits
  renormalize: bool = True  # top-k gate weights divided by their sum
  route_scale: float = 1.0  # routed output multiplied by this (DeepSeek-V3: 2.5)
  dispatch: str = "dropless"  # one of DISPATCH: sorted grouped matmul, or capacity buffers that drop
  grouped_matmul: str = "auto"  # dropless, one of GROUPED_MATMUL: auto = ragged_dot on TPU, tiles elsewhere
  capacity_factor: float = 1.25  # capacity: slots per expert = ceil(factor * tokens * top_k / n_experts)
  moe_first_dense: int = 0  # the first n layers keep a dense MLP
  moe_every: int = 1  # after those, every k-th layer is MoE (1 = all)
  aux_loss_weight: float = 0.01  # load-balancing loss (Switch/GShard: E * sum_e f_e * p_e)
  router_z_weight: float = 0.001  # router z-loss (ST-MoE: mean logsumexp(router logits)^2)
  bias_update_rate: float = 0.0  # auxiliary-loss-free balancing (DeepSeek-V3): per-expert bias step; 0 = off
  # The block's residual add + mlp_norm as one op (jaxtrain/kernels/rms_norm): one of FUSED_NORM; "off" keeps
  # the separate add and RMSNorm module (same parameters either way).
  fused_norm: str = "off"
  # RoPE scaling (jaxtrain/model/layers.py FREQUENCIES): rotary frequencies stretched past the context
  # the model was pre-trained on, computed as HF transformers' ROPE_INIT_FUNCTIONS compute them.
  rope_scaling: str = "none"  # one of ROPE_SCALINGS
  rope_factor: float = 1.0  # linear, llama3, yarn: how many times the pre-training context is stretched
  rope_original_max_len: int = 0  # llama3, yarn: the pre-training context (HF original_max_position_embeddings)
  rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by the factor
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
  rope_beta_fast: float = 32.0  # yarn: rotations over original_max_len above which a frequency is kept
  rope_beta_slow: float = 1.0  # yarn: rotations below which it is divided by the factor
  rope_attention_factor: float = 0.0  # yarn: cos and sin are multiplied by this; 0 = 0.1 ln(factor) + 1
  # Attention implementation (jaxtrain/model/attention.py)
  attention: str = "auto"  # one of ATTENTION; auto: splash on TPU, cudnn on GPU (pallas if packed), CPU by length
  attention_block: int = 512  # blockwise: keys/values (and queries) per block
  # FP8 dense and expert matmuls (jaxtrain/model/fp8.py): one of FP8; "current" = e4m3 forward, e5m2
  # gradients, per-tensor scales from each tensor's own amax. Router, embedding, head, attention core stay.
  fp8: str = "off"

  @property
  def expert_d_ff(self) -> int:
    return self.d_ff_expert or self.d_ff

  @classmethod
  def from_config(cls, m) -> "ModelConfig":
    """From the `model` section of a config (a ConfigDict or a saved config's dict)."""
    return cls(**{f.name: m[f.name] for f in dataclasses.fields(cls) if f.name in m})


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))

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
  t.device_memory_gib = 0.0  # batch_size/microbatches=auto: the per-device limit; 0 = the device's own (CPU: set it)
  t.log_every = 20
  t.eval_every = 200
  t.eval_batches = 4
  t.z_loss = 0.0
  # The output projection + loss (jaxtrain/kernels/cross_entropy): "full" materializes the [B, L, V] float32
  # logits; "chunked" fuses them into the loss tile by tile (O(chunk) memory, same values up to reassociation);
  # "pallas" does so in Pallas kernels (tiles of the op's block_n x block_v, interpreted on CPU).
  t.cross_entropy = "full"  # one of CROSS_ENTROPY
  t.ce_token_chunk = 1024  # chunked: tokens per tile
  t.ce_vocab_chunk = 8192  # chunked: vocabulary columns per tile
  t.peer_timeout_s = 60.0  # multi-process: a peer silent this long is lost; the others end with status 6
  t.gpu_hour_price = 0.0  # price of one GPU-hour (one host-hour on CPU): cost per million tokens; 0 = not shown
  t.task = "lm"  # one of TASKS: lm (pre-training), sft, rm (reward model), dpo, grpo, ppo (jaxtrain/posttrain)

  # Post-training tasks (train.task sft, rm, dpo; jaxtrain/posttrain). Data: JSONL rows of prompt/completion,
  # chat `messages` [{role, content}], or preference pairs prompt/chosen/rejected (chat lists allowed for the
  # completions too). Tokenizer: the data section's (synthetic: symbols, bytes: bytes, text: data.tokenizer).
  c.posttrain = p = ml_collections.ConfigDict()
  p.train_path = ""  # JSONL; "" = a synthetic reversal task written into WORKDIR/posttrain_data
  p.eval_path = ""  # JSONL; "" = eval_fraction of the train rows held out
  p.eval_fraction = 0.1
  p.prompt_field = "prompt"
  p.completion_field = "completion"
  p.messages_field = "messages"
  p.chosen_field = "chosen"
  p.rejected_field = "rejected"
  p.synthetic_examples = 2000  # rows of the synthetic task when train_path is ""
  p.loss = "dpo"  # dpo: one of PREFERENCE_LOSSES (simpo is reference-free)
  p.beta = 0.1  # dpo/ipo: the KL strength (ipo: 1/(2 beta) is the target margin); simpo: the reward scale
  p.label_smoothing = 0.0  # dpo, rm: the assumed share of flipped labels (conservative DPO, cDPO)
  p.simpo_gamma = 0.5  # simpo: the target margin between the length-normalized rewards
  p.rm_center = 0.0  # rm: weight of mean(score^2), which keeps rewards centred near zero
  # RL (train.task grpo, ppo; jaxtrain/posttrain/grpo.py, ppo.py): train.batch_size prompts a step, each
  # sampled group_size times; train.seq_len = prompt slots + max_new_tokens. Prompts: JSONL rows with
  # prompt_field and any other fields (e.g. `answer`) passed to the reward functions; "" = the addition task
  # (jaxtrain/posttrain/exact.py) written into WORKDIR/posttrain_data/rl.jsonl.
  p.group_size = 4  # samples per prompt (grpo: >= 2, the group of its advantages; ppo: usually 1)
  p.max_new_tokens = 8  # response tokens sampled per prompt (a row stops at EOS)
  p.temperature = 1.0  # sampling temperature (> 0); the loss's log-probs use the same
  p.top_k = 0  # sampling: 0 = the whole vocabulary
  p.top_p = 1.0  # sampling: nucleus mass (1.0 = off)
  p.clip_eps = 0.2  # the clipped ratio's epsilon
  p.kl_coef = 0.04  # KL to the frozen reference: grpo's loss term (k3), ppo's per-token reward penalty (k1); 0 = none
  p.aggregate = "token"  # one of RL_AGGREGATES: a loss unit is a response token or a sequence
  p.advantage_scale = "std"  # grpo: one of ADVANTAGE_SCALES
  p.gamma = 1.0  # ppo: discount of GAE
  p.lam = 0.95  # ppo: lambda of GAE
  p.value_coef = 0.5  # ppo: weight of the value loss
  p.value_clip = 0.2  # ppo: value clipping around the rollout's values (0 = off)
  p.rewards = "exact_match:1.0"  # reward functions on decoded text, "name:weight,name:weight" (posttrain/rewards.py)
  p.reward_model = ""  # the workdir of a reward-model run (train.task=rm), its score added to the rewards
  p.reward_model_weight = 1.0

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
  o.skip_nonfinite = True  # an update with a non-finite gradient or value is skipped (counted: skipped_steps)
  o.max_consecutive_skips = 20  # that many skipped updates in a row: the run has diverged (see on_divergence)
  o.on_divergence = "stop"  # one of ON_DIVERGENCE: stop (exit status 4), or rollback to the last good checkpoint
  o.max_rollbacks = 3  # rollback: give up (stop) after this many
  # Gradient reduction. "" = implicit (GSPMD all-reduces the gradient of the global batch); a mesh axis
  # name = the step computes each shard's gradient over that data axis and the optimizer chain reduces
  # them explicitly (jaxtrain/optim/reduce.py), the seam for compressed reductions.
  o.reduce_axis = ""

  # Communication-efficient training over one slow mesh axis (jaxtrain/optim/compress.py, diloco.py).
  c.comm = cm = ml_collections.ConfigDict()
  cm.axis = "replica"  # the slow axis whose gradient reduction is compressed (the fast axes stay float32)
  cm.format = "f32"  # one of COMM_FORMATS; f32 with error_feedback=none is plain data parallelism
  cm.block = 256  # int8/int4 (and diloco.format): elements per absmax scale; even
  cm.error_feedback = "none"  # one of ERROR_FEEDBACK: none, ef (residual into the next step), ef21
  cm.kernel = "xla"  # one of COMM_KERNELS: who quantizes (pallas: one fused pass, jaxtrain/kernels/quantize; same bits)

  c.diloco = dl = ml_collections.ConfigDict()
  dl.inner_steps = 0  # H: inner steps per replica between syncs over comm.axis; 0 = off (data parallel)
  dl.outer_lr = 0.7
  dl.outer_momentum = 0.9  # Nesterov
  dl.format = "f32"  # one of COMM_FORMATS: the outer gradients' format on the wire
  dl.fragments = 1  # P: streaming DiLoCo syncs 1/P of the parameters every H/P steps, staggered
  dl.delay = 0  # tau: a fragment's average is applied tau inner steps after it was sent (overlap)
  dl.mix = 0.5  # with delay: local = mix * local + (1 - mix) * new global for the fragment
  dl.drop_prob = 0.0  # simulation: each replica misses each sync with this probability (left out, rejoins)

  c.mesh = x = ml_collections.ConfigDict()
  x.replica = 1
  x.data = -1
  x.fsdp = 1
  x.expert = 1
  x.context = 1  # the sequence split over this many devices (context parallelism); seq_len divides into 2x chunks
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
  k.compress = False  # zstd on the arrays: barely smaller for trained weights, much slower (benchmarks/RESULTS.md)
  k.init_from = ""  # start from the params of another checkpoint (a converted HF model, a run dir)

  c.sample = s = ml_collections.ConfigDict()
  s.prompt = ""
  s.max_new_tokens = 64
  s.temperature = 0.8
  s.top_k = 20
  return c


def mesh_shape(x, device_count: int) -> dict[str, int]:
  """Mesh axis sizes of the `mesh` section `x`, with the one -1 filled from the device count."""
  sizes = {a: int(x[a]) for a in MESH_AXES}
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


# RoPE scaling: none; linear = position interpolation (Chen et al., 2023); llama3 = Llama 3.1's frequency-dependent
# scaling; yarn (Peng et al., 2023). The math: jaxtrain/model/layers.py; HF import/export: checkpoint/hf.py.
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


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
