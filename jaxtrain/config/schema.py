"""The config schema: every key, its default and the choices it takes. No jax import here.

A config file in `configs/` starts from `default_config()` and changes values; `checks.validate` says
whether the result can run."""

import dataclasses

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
# RoPE scaling: none; linear = position interpolation (Chen et al., 2023); llama3 = Llama 3.1's frequency-dependent
# scaling; yarn (Peng et al., 2023). The math: jaxtrain/model/layers.py; HF import/export: checkpoint/hf.py.
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
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
