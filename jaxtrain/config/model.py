"""The `model` section: `ModelConfig` (every model default, written once), the choices its keys
take, and its checks. No jax import here."""

import dataclasses
import math
import re

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice, check_floats

ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")
GROUPED_MATMUL = ("auto", "tiles", "ragged_dot")
REMAT = ("none", "dots", "full")
DTYPES = ("float32", "bfloat16")
FUSED_NORM = ("off", "xla", "pallas")  # off, or jaxtrain/kernels/rms_norm/ops.py IMPLEMENTATIONS
ATTENTION = ("auto", "xla", "xla_causal", "blockwise", "cudnn", "pallas", "splash")
# RoPE scaling: none; linear = position interpolation (Chen et al., 2023); llama3 = Llama 3.1's
# frequency-dependent scaling; yarn (Peng et al., 2023). The math: jaxtrain/model/layers.py; HF
# import/export: checkpoint/hf.py.
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
FP8 = ("off", "current")  # jaxtrain/model/fp8.py MODES
PROJECTION_VJP = ("auto", "jax", "einsum")  # jaxtrain/model/dense.py PROJECTION_VJP
# decoder: jaxtrain/model/transformer.py; encoder: the BERT-style bidirectional encoder of
# jaxtrain/model/encoder.py, trained by train.task=mlm
ARCHS = ("decoder", "encoder")
POSITIONS = ("rope", "learned")  # rotary (the decoder's only), or learned absolute embeddings
# what the encoder runs (its blocks are BERT's; kernels are not checked bidirectional yet)
ENCODER_ATTENTION = ("auto", "xla", "blockwise")
# (low, high, whether low itself is allowed) for float settings; high is inclusive unless math.inf.
RANGES = {"model.rope_theta": (0.0, math.inf, False), "model.norm_eps": (0.0, 1.0, False),
          "model.init_std": (0.0, math.inf, False), "model.route_scale": (0.0, math.inf, False)}


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
  # one of REMAT; saves memory with scan_layers (XLA:CPU unrolled: none, with or without CSE)
  remat: str = "none"
  scan_layers: bool = True  # False unrolls the layer loop (same parameter tree); faster on CPU
  init_std: float = 0.02
  # Mixture of experts (jaxtrain/model/moe.py); n_experts = 0 is a dense model.
  n_experts: int = 0  # routed experts per MoE layer
  top_k: int = 2  # experts per token
  d_ff_expert: int = 0  # hidden size of each routed (and shared) expert; 0 = d_ff
  # experts every token goes through (DeepSeek), SwiGLU of n * d_ff_expert
  n_shared_experts: int = 0
  router: str = "softmax"  # one of ROUTERS: scores = softmax or sigmoid of the router logits
  renormalize: bool = True  # top-k gate weights divided by their sum
  route_scale: float = 1.0  # routed output multiplied by this (DeepSeek-V3: 2.5)
  # one of DISPATCH: sorted grouped matmul, or capacity buffers that drop
  dispatch: str = "dropless"
  # dropless, one of GROUPED_MATMUL: auto = ragged_dot on TPU, tiles elsewhere
  grouped_matmul: str = "auto"
  # capacity: slots per expert = ceil(factor * tokens * top_k / n_experts)
  capacity_factor: float = 1.25
  moe_first_dense: int = 0  # the first n layers keep a dense MLP
  moe_every: int = 1  # after those, every k-th layer is MoE (1 = all)
  aux_loss_weight: float = 0.01  # load-balancing loss (Switch/GShard: E * sum_e f_e * p_e)
  router_z_weight: float = 0.001  # router z-loss (ST-MoE: mean logsumexp(router logits)^2)
  # auxiliary-loss-free balancing (DeepSeek-V3): per-expert bias step; 0 = off
  bias_update_rate: float = 0.0
  # The block's residual add + mlp_norm as one op (jaxtrain/kernels/rms_norm): one of FUSED_NORM;
  # "off" keeps the separate add and RMSNorm module (same parameters either way).
  fused_norm: str = "off"
  # RoPE scaling (jaxtrain/model/layers.py FREQUENCIES): rotary frequencies stretched past the
  # context the model was pre-trained on, computed as HF transformers' ROPE_INIT_FUNCTIONS compute
  # them.
  rope_scaling: str = "none"  # one of ROPE_SCALINGS
  # linear, llama3, yarn: how many times the pre-training context is stretched
  rope_factor: float = 1.0
  # llama3, yarn: the pre-training context (HF original_max_position_embeddings)
  rope_original_max_len: int = 0
  # llama3: wavelengths above original_max_len / this are divided by the factor
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
  # yarn: rotations over original_max_len above which a frequency is kept
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0  # yarn: rotations below which it is divided by the factor
  # yarn: cos and sin are multiplied by this; 0 = 0.1 ln(factor) + 1
  rope_attention_factor: float = 0.0
  # Attention implementation (jaxtrain/model/attention.py): one of ATTENTION; auto: splash on TPU,
  # cudnn on GPU (the Pallas flash kernel for packed rows, permuted indices or float32), CPU by
  # length (xla_causal: xla skipping the scores above the diagonal; blockwise from 2048 keys);
  # permuted indices on TPU: xla, blockwise from 2048 keys
  attention: str = "auto"
  attention_block: int = 512  # blockwise: keys/values (and queries) per block
  # FP8 dense and expert matmuls (jaxtrain/model/fp8.py): one of FP8; "current" = e4m3 forward, e5m2
  # gradients, per-tensor scales from each tensor's own amax. Router, embedding, head, attention
  # core stay.
  fp8: str = "off"
  # How the dense projections' gradients are formed (jaxtrain/model/dense.py): one of
  # PROJECTION_VJP; "jax" = jax's transpose of the einsum, "einsum" = two einsums written out (no
  # transposed copy of the output gradient on XLA:CPU); auto = einsum on CPU, jax elsewhere
  projection_vjp: str = "auto"
  # Pipeline (mesh.stage > 1, jaxtrain/model/pipeline.py): each stage runs its layers this many
  # times per microbatch, holding layers s, s + S, ... in units of n_layers / (S x repeats); 1 =
  # GPipe. More repeats shrink the bubble (S - 1) / (M x repeats + S - 1).
  pipeline_repeats: int = 1
  # LoRA fine-tuning (jaxtrain/core/lora.py; Hu et al., 2021): adapters of this rank on the weights
  # whose '/'-joined path lora_targets matches in full (a regex; kinds: model/lora.py WEIGHTS), the
  # base frozen at checkpoint.init_from, scale lora_alpha / lora_rank; 0 = off (full fine-tuning)
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: str = r".*attn/(q|v)"
  # the frozen base's layer weights in int8, a scale per output channel (QLoRA-style; model/lora.py);
  # 0 = the base's own dtype
  lora_base_bits: int = 0
  # The architecture, one of ARCHS: "encoder" is BERT's (post-LayerNorm blocks with biases, GELU
  # MLP, embedding LayerNorm, masked-LM head; jaxtrain/model/encoder.py), for train.task=mlm
  arch: str = "decoder"
  positions: str = "rope"  # encoder: one of POSITIONS (learned: max_seq_len embeddings, as BERT)
  type_vocab_size: int = 2  # encoder: token-type (sentence A/B) embeddings, as BERT; 0 = none

  @property
  def expert_d_ff(self) -> int:
    return self.d_ff_expert or self.d_ff

  @classmethod
  def from_config(cls, m) -> "ModelConfig":
    """From the `model` section of a config (a ConfigDict or a saved config's dict)."""
    return cls(**{f.name: m[f.name] for f in dataclasses.fields(cls) if f.name in m})


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """The `model.vision` sub-section: the image encoder of train.task=vlm (jaxtrain/model/vision.py),
  a ViT over image_size^2 images cut into (image_size / patch_size)^2 patches, each of which takes
  the place of one `image_token` in the text."""
  image_size: int = 16  # square images, pixels a side
  patch_size: int = 4  # square patches, pixels a side; image_size divisible by it
  channels: int = 3
  d_model: int = 64  # the encoder's width (its MLP 4x); the projector maps it to model.d_model
  n_layers: int = 2
  n_heads: int = 4
  image_token: int = -1  # the placeholder id; -1: model.vocab_size - 1
  freeze: bool = False  # the encoder's params get no updates (held in the task state)

  @property
  def patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @classmethod
  def from_config(cls, v) -> "VisionConfig":
    return cls(**{f.name: v[f.name] for f in dataclasses.fields(cls) if f.name in v})


def model_defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))
  c.vision = ml_collections.ConfigDict(dataclasses.asdict(VisionConfig()))
  return c


def image_token(m) -> int:
  """The placeholder id of the model section `m`: model.vision.image_token, -1: the last id."""
  return m.vision.image_token if m.vision.image_token >= 0 else m.vocab_size - 1


def validate_vision(cfg, shape) -> None:
  """train.task=vlm: the dense decoder without stages or context, full logits, and an encoder
  whose patches tile the image and whose heads divide its width; a placeholder in the vocabulary."""
  m, v = cfg.model, cfg.model.vision
  if cfg.train.task != "vlm":
    return
  for key in ("image_size", "patch_size", "channels", "d_model", "n_layers", "n_heads"):
    if v[key] <= 0:
      raise ConfigError(f"model.vision.{key} must be positive, got {v[key]}")
  if v.image_size % v.patch_size:
    raise ConfigError(f"model.vision.image_size={v.image_size} is not divisible by "
                      f"model.vision.patch_size={v.patch_size}")
  if v.d_model % v.n_heads:
    raise ConfigError(f"model.vision.d_model={v.d_model} is not divisible by "
                      f"model.vision.n_heads={v.n_heads}")
  if not -1 <= v.image_token < m.vocab_size:
    raise ConfigError(f"model.vision.image_token={v.image_token} is not in the vocabulary "
                      f"(-1 = model.vocab_size - 1 = {m.vocab_size - 1})")
  if m.n_experts or shape["stage"] > 1 or shape["context"] > 1:
    raise ConfigError("train.task=vlm runs a dense decoder without pipeline stages or context "
                      "parallelism (model.n_experts 0, mesh.stage and mesh.context 1)")
  if cfg.train.cross_entropy != "full":
    raise ConfigError(f"train.cross_entropy={cfg.train.cross_entropy!r}: train.task=vlm computes "
                      "its logits in full")
  if cfg.eval.tasks:
    raise ConfigError("eval.tasks score text alone: not run on train.task=vlm (its eval_accuracy "
                      "is the held-out rows')")


def validate_model(cfg, shape) -> None:
  """The model section's checks, on the mesh `shape` and rule preset it is laid out with."""
  m, rules = cfg.model, cfg.mesh.rules
  for key, choices in (("remat", REMAT), ("param_dtype", DTYPES), ("compute_dtype", DTYPES),
                       ("router", ROUTERS), ("dispatch", DISPATCH),
                       ("grouped_matmul", GROUPED_MATMUL), ("fused_norm", FUSED_NORM),
                       ("attention", ATTENTION), ("fp8", FP8),
                       ("projection_vjp", PROJECTION_VJP)):
    check_choice(f"model.{key}", m[key], choices)
  for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "max_seq_len", "attention_block"):
    if m[key] <= 0:
      raise ConfigError(f"model.{key} must be positive, got {m[key]}")
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(
        f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
  tp = shape["tensor"]
  for key in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
    if m[key] % tp:
      raise ConfigError(f"model.{key}={m[key]} is not divisible by the tensor axis ({tp})")
  if rules != "dp" and m.d_model % shape["fsdp"]:
    raise ConfigError(
        f"model.d_model={m.d_model} is not divisible by the fsdp axis ({shape['fsdp']})")
  if m.n_experts:
    _validate_moe(m, shape, rules)
  validate_rope(m)
  check_floats("model", m, RANGES)
  validate_lora(cfg)
  validate_arch(cfg, shape)
  validate_vision(cfg, shape)


def validate_arch(cfg, shape) -> None:
  """model.arch and model.positions: the encoder takes what its module implements, one line for
  each decoder-only feature; the decoder has rotary positions only."""
  m = cfg.model
  check_choice("model.arch", m.arch, ARCHS)
  check_choice("model.positions", m.positions, POSITIONS)
  if m.arch == "decoder":
    if m.positions != "rope":
      raise ConfigError(f"model.positions={m.positions!r}: the decoder has rotary positions only "
                        "(learned positions are the encoder's: model.arch=encoder)")
    return
  if m.type_vocab_size < 0:
    raise ConfigError(f"model.type_vocab_size must be >= 0, got {m.type_vocab_size}")
  if m.attention not in ENCODER_ATTENTION:
    raise ConfigError(f"model.attention={m.attention!r}: the encoder runs "
                      f"{', '.join(ENCODER_ATTENTION)} (no kernel is checked bidirectional yet)")
  off = {"n_experts": 0, "fused_norm": "off", "fp8": "off", "lora_rank": 0}
  for key, want in off.items():
    if m[key] != want:
      raise ConfigError(f"model.{key}={m[key]!r} is the decoder's; model.arch=encoder needs "
                        f"{want!r}")
  if shape["stage"] > 1 or shape["context"] > 1:
    raise ConfigError("model.arch=encoder runs without pipeline stages or context parallelism "
                      "(mesh.stage and mesh.context 1)")


# tasks run with LoRA (the reward model's loss on a fresh head is not tested with it yet)
LORA_TASKS = ("lm", "sft", "dpo", "grpo", "ppo")


def validate_lora(cfg) -> None:
  """model.lora_*: a rank >= 0, base bits 0 or 8 (only with a rank); with a rank, a base
  (checkpoint.init_from), a task of LORA_TASKS, a positive alpha and a pattern that compiles (one
  matching no weight: at build, core/lora.py)."""
  m = cfg.model
  if m.lora_rank < 0:
    raise ConfigError(f"model.lora_rank must be >= 0 (0 = off), got {m.lora_rank}")
  if m.lora_base_bits not in (0, 8):
    raise ConfigError(f"model.lora_base_bits must be 0 (the base's dtype) or 8 (int8), got "
                      f"{m.lora_base_bits!r}")
  if not m.lora_rank:
    if m.lora_base_bits:
      raise ConfigError("model.lora_base_bits=8 quantizes a LoRA run's frozen base: set "
                        "model.lora_rank > 0")
    return
  if not cfg.checkpoint.init_from:
    raise ConfigError("model.lora_rank > 0 trains adapters of a base: set checkpoint.init_from")
  if cfg.train.task not in LORA_TASKS:
    raise ConfigError(f"model.lora_rank > 0 with train.task={cfg.train.task!r}: LoRA runs "
                      f"{', '.join(LORA_TASKS)} for now")
  if not m.lora_alpha > 0:
    raise ConfigError(f"model.lora_alpha must be positive, got {m.lora_alpha}")
  try:
    re.compile(m.lora_targets)
  except re.error as e:
    raise ConfigError(f"model.lora_targets={m.lora_targets!r} is not a regex ({e})") from None
  if cfg.eval.tasks:
    raise ConfigError("model.lora_rank > 0: in-loop eval.tasks are not run on adapters yet; "
                      "evaluate the run's workdir after (`python -m jaxtrain eval`)")


def _validate_moe(m, shape, rules):
  if m.n_experts < 0 or not 1 <= m.top_k <= m.n_experts:
    raise ConfigError(f"model.top_k={m.top_k} must be in [1, model.n_experts={m.n_experts}]")
  if not 0 <= m.moe_first_dense < m.n_layers:
    raise ConfigError(f"model.moe_first_dense={m.moe_first_dense} must be in [0, model.n_layers="
                      f"{m.n_layers})")
  if m.moe_every < 1 or (m.n_layers - m.moe_first_dense) % m.moe_every:
    raise ConfigError(f"model.moe_every={m.moe_every} does not divide the "
                      f"{m.n_layers - m.moe_first_dense} layers after model.moe_first_dense")
  if (m.capacity_factor <= 0 or m.bias_update_rate < 0 or m.aux_loss_weight < 0
      or m.router_z_weight < 0):
    raise ConfigError(
        "model.capacity_factor must be positive; bias_update_rate, aux_loss_weight and "
        "router_z_weight must be >= 0")
  if m.d_ff_expert < 0 or m.n_shared_experts < 0:
    raise ConfigError("model.d_ff_expert and model.n_shared_experts must be >= 0")
  if rules.endswith("_ep") and m.n_experts % shape["expert"]:
    raise ConfigError(f"model.n_experts={m.n_experts} is not divisible by the expert axis "
                      f"({shape['expert']})")
  if "tp" in rules and (m.d_ff_expert or m.d_ff) % shape["tensor"]:
    raise ConfigError(
        f"the expert hidden size is not divisible by the tensor axis ({shape['tensor']})")


def validate_rope(m) -> None:
  """ConfigError (one line) unless the model section's (or a ModelConfig's) rope scaling can be
  computed."""
  check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
  if m.rope_scaling == "none":
    return
  if not m.rope_factor > 0:
    raise ConfigError(
        f"model.rope_factor must be positive with rope_scaling={m.rope_scaling!r}, got "
        f"{m.rope_factor}")
  if m.rope_scaling in ("llama3", "yarn") and m.rope_original_max_len <= 0:
    raise ConfigError(
        f"model.rope_scaling={m.rope_scaling!r} needs model.rope_original_max_len (the "
        f"pre-training context) > 0, got {m.rope_original_max_len}")
  if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
    raise ConfigError(
        f"model.rope_low_freq_factor={m.rope_low_freq_factor} and rope_high_freq_factor="
        f"{m.rope_high_freq_factor} must satisfy 0 < low < high")
  if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow < m.rope_beta_fast:
    raise ConfigError(
        f"model.rope_beta_slow={m.rope_beta_slow} and rope_beta_fast={m.rope_beta_fast} "
        "must satisfy 0 < slow < fast")
  if m.rope_attention_factor < 0:
    raise ConfigError(f"model.rope_attention_factor must be >= 0 (0 = derived), got "
                      f"{m.rope_attention_factor}")
