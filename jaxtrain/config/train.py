"""The `train` section: what a run trains and how long, its defaults and checks. No jax import
here."""

import math

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice, check_floats

# jaxtrain/kernels/cross_entropy/ops.py IMPLEMENTATIONS
CROSS_ENTROPY = ("full", "chunked", "pallas")
# train.batch_size and train.microbatches may be "auto": the planner picks the largest batch (the
# fewest microbatches) that fits train.device_memory_gib, confirmed by a compile
# (jaxtrain/plan/auto.py)
AUTO = "auto"
AUTO_KEYS = ("train.batch_size", "train.microbatches")
# Host offload (jaxtrain/core/offload.py): none, the optimizer state or the params kept in pinned
# host memory between steps, or each layer's saved input (remat) offloaded during the step
OFFLOAD = ("none", "optimizer", "params", "activations")
RANGES = {"train.z_loss": (0.0, math.inf, True), "train.device_memory_gib": (0.0, math.inf, True)}


def train_defaults() -> ml_collections.ConfigDict:
  t = ml_collections.ConfigDict()
  t.steps = 600
  t.batch_size = 32
  t.seq_len = 128
  t.seed = 0
  t.microbatches = 1
  # mesh.stage > 1: each (gradient-accumulation) microbatch is cut again into this many, which flow
  # through the pipeline's stages one after another (jaxtrain/model/pipeline.py); 0 = one per stage
  t.pipeline_microbatches = 0
  # batch_size/microbatches=auto: the per-device limit; 0 = the device's own (CPU: set it)
  t.device_memory_gib = 0.0
  t.log_every = 20
  # optimizer steps per jitted call: a scan over this many batches fed together (bitwise the same
  # steps; fewer dispatches). Calls end where a save, an evaluation or a health check is due, and the
  # steps before one run singly; every step's metrics are still logged (jaxtrain/train/calls.py)
  t.steps_per_call = 1
  t.eval_every = 200
  t.eval_batches = 4
  t.z_loss = 0.0
  # The output projection + loss (jaxtrain/kernels/cross_entropy): "full" materializes the [B, L, V]
  # float32 logits; "chunked" fuses them into the loss tile by tile (O(chunk) memory, same values up
  # to reassociation); "pallas" does so in Pallas kernels (tiles of the op's block_n x block_v,
  # interpreted on CPU).
  t.cross_entropy = "full"  # one of CROSS_ENTROPY
  t.ce_token_chunk = 1024  # chunked: tokens per tile
  t.ce_vocab_chunk = 8192  # chunked: vocabulary columns per tile
  # JAX's persistent compilation cache (jaxtrain/train/restart.py): "workdir" = WORKDIR/jax_cache
  # unless JAX_COMPILATION_CACHE_DIR is set, a directory, or "" (jax's own setting): a restart
  # loads the compiled step instead of compiling it
  t.compilation_cache = "workdir"
  # multi-process: a peer silent this long is lost; the others exit status 6
  t.peer_timeout_s = 60.0
  # fault injection (tools/soak.py): the steps (comma-separated) whose batch is NaN-poisoned (its
  # float arrays, e.g. the loss mask), which the non-finite update check must skip; "" = none
  t.nan_steps = ""
  # price of one GPU-hour (one host-hour on CPU): cost per million tokens; 0 = not shown
  t.gpu_hour_price = 0.0
  # one of OFFLOAD; TPU and GPU only (the CPU backend executes no memory kinds: refused there)
  t.offload = "none"
  # one of jaxtrain/builder.py TASKS: lm (pre-training), mlm (masked-LM pre-training of the
  # encoder), vlm (image-text: jaxtrain/core/vlm.py, model.vision), sft, rm (reward model), dpo,
  # grpo, ppo (jaxtrain/posttrain)
  t.task = "lm"
  # train.task=mlm (jaxtrain/core/mlm.py): BERT's masking, mask_prob of the tokens predicted (of
  # those 80% become mask_token, 10% a random token, 10% stay); mask_token -1: model.vocab_size - 1,
  # an id the synthetic and byte data never emit
  t.mask_prob = 0.15
  t.mask_token = -1
  return t


def validate_train(cfg, shape) -> None:
  """The train section's checks, on the mesh `shape` its batch is split over."""
  t, m = cfg.train, cfg.model
  check_choice("train.cross_entropy", t.cross_entropy, CROSS_ENTROPY)
  check_choice("train.offload", t.offload, OFFLOAD)
  if t.offload == "activations" and (m.remat == "none" or shape["stage"] > 1):
    raise ConfigError("train.offload=activations offloads the layer inputs that remat keeps for "
                      "the backward pass: set model.remat=dots or full, without pipeline stages")
  if t.offload == "params" and t.task in ("grpo", "ppo"):
    raise ConfigError(f"train.offload=params: {t.task}'s rollouts read the params outside the "
                      f"step; offload the optimizer instead")
  for key in ("steps", "batch_size", "seq_len", "microbatches", "log_every", "peer_timeout_s",
              "ce_token_chunk", "ce_vocab_chunk", "steps_per_call"):
    auto = f"train.{key}" in AUTO_KEYS
    if t[key] == AUTO and auto:
      continue
    if isinstance(t[key], str) or t[key] <= 0:
      raise ConfigError(f"train.{key} must be positive{' or auto' if auto else ''}, got {t[key]!r}")
  if not isinstance(t.compilation_cache, str):
    raise ConfigError(f"train.compilation_cache must be 'workdir', a directory or '' (jax's own "
                      f"setting), got {t.compilation_cache!r}")
  if t.gpu_hour_price < 0:
    raise ConfigError(f"train.gpu_hour_price must be >= 0 (0 = no cost estimate), got "
                      f"{t.gpu_hour_price}")
  if t.seq_len > m.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}")
  data_ways = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"]
  if AUTO not in (t.batch_size, t.microbatches) and t.batch_size % (data_ways * t.microbatches):
    raise ConfigError(
        f"train.batch_size={t.batch_size} does not divide into {t.microbatches} microbatch(es) "
        f"over the {data_ways} data-parallel devices (replica*data*fsdp*expert)")
  if t.steps_per_call > 1 and t.task in ("grpo", "ppo"):
    raise ConfigError(f"train.steps_per_call={t.steps_per_call}: {t.task} samples each step's "
                      f"rollouts from the params between steps; set train.steps_per_call=1")
  if t.steps_per_call > 1 and t.offload != "none":
    raise ConfigError(f"train.steps_per_call={t.steps_per_call} with train.offload={t.offload}: "
                      f"the offloaded state moves between host and device around each call's "
                      f"single step; set train.steps_per_call=1")
  check_floats("train", t, RANGES)
  nan_steps(t)
  validate_mlm(cfg)


def nan_steps(t) -> frozenset:
  """train.nan_steps as a set of steps (one ConfigError line when it is not a list of them)."""
  try:
    steps = frozenset(int(s) for s in t.nan_steps.split(",") if s.strip())
  except (AttributeError, ValueError):
    steps = None
  if steps is None or any(s < 1 for s in steps):
    raise ConfigError(f"train.nan_steps must be comma-separated steps >= 1, got {t.nan_steps!r}")
  return steps


def validate_mlm(cfg) -> None:
  """train.task=mlm: the encoder (model.arch), its full logits, a mask probability in (0, 1) and a
  mask token in the vocabulary."""
  t, m = cfg.train, cfg.model
  if (t.task == "mlm") != (m.arch == "encoder"):
    raise ConfigError(f"train.task={t.task!r} with model.arch={m.arch!r}: masked-LM pre-training "
                      "(mlm) trains the encoder, every other task the decoder")
  if t.task != "mlm":
    return
  if t.cross_entropy != "full":
    raise ConfigError(f"train.cross_entropy={t.cross_entropy!r}: the masked-LM head (transform, "
                      "tied decoder and bias) computes its logits in full")
  if not 0 < t.mask_prob < 1:
    raise ConfigError(f"train.mask_prob must be in (0, 1), got {t.mask_prob}")
  if not -1 <= t.mask_token < m.vocab_size:
    raise ConfigError(f"train.mask_token={t.mask_token} is not in the vocabulary "
                      f"(-1 = model.vocab_size - 1 = {m.vocab_size - 1})")
