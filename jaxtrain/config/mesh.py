"""The `mesh` section: axis sizes, the logical-axis rule presets, and their checks. No jax import
here."""

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice
from jaxtrain.config.train import AUTO

# Logical axis -> mesh axes, one table per preset (`mesh.rules`); only jaxtrain/parallel applies
# them. Every data-like axis splits the batch; `fsdp` also splits parameters, `tensor` never the
# batch. Flax resolves rules in order and skips a mesh axis a dimension already uses, so an
# activation [batch, seq, embed] gets fsdp on batch only, while a [vocab, embed] weight gets it on
# embed.
DATA_AXES = ("replica", "data", "fsdp", "expert")
# The sequence splits over `context` (context parallelism, jaxtrain/model/context.py). Its rule
# comes first, so a [batch, seq, ...] activation takes `context` on seq and the data axes on batch;
# an array with a batch but no seq (nothing the dense model has today) takes `context` on its batch
# too.
_SEQ = [("seq", "context")]
# "replica", "data_shards": one copy of a state per shard of that mesh axis (optimizer buffers)
_BATCH = _SEQ + [("batch", DATA_AXES + ("context",)), ("batch", DATA_AXES), ("replica", "replica"),
                 ("data_shards", "data")]
_FSDP = [("embed", "fsdp")]
_EP = [("expert", "expert")]  # experts over the expert axis; tokens travel to them by all-to-all
_TP = [("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]
# The stacked layers' leading axis over the pipeline stages (jaxtrain/model/pipeline.py), in every
# preset: a size-1 stage axis changes nothing.
_STAGE = [("layers", "stage")]
RULES = {
    "dp": _BATCH + _STAGE,
    "fsdp": _BATCH + _FSDP + _STAGE,
    "fsdp_tp": _BATCH + _FSDP + _TP + _STAGE,
    "fsdp_ep": _BATCH + _EP + _FSDP + _STAGE,
    "fsdp_tp_ep": _BATCH + _EP + _FSDP + _TP + _STAGE,
}
PRESETS = tuple(RULES)
# stage sits next to replica: it sends one microbatch's activations per iteration, the least
# traffic of any axis, so it may take the slow links; context sits next to tensor: it gathers keys
# and values every layer, so it wants the fast links
MESH_AXES = ("replica", "stage", "data", "fsdp", "expert", "context", "tensor")


def mesh_defaults() -> ml_collections.ConfigDict:
  x = ml_collections.ConfigDict()
  x.replica = 1
  x.stage = 1  # pipeline stages: the layers split over this many (jaxtrain/model/pipeline.py)
  x.data = -1
  x.fsdp = 1
  x.expert = 1
  x.context = 1  # the sequence split over this many devices; seq_len divides into 2x chunks
  x.tensor = 1
  x.rules = "fsdp"  # one of PRESETS
  return x


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


def validate_mesh(cfg, device_count: int) -> dict[str, int]:
  """The mesh section's checks; returns the mesh shape."""
  check_choice("mesh.rules", cfg.mesh.rules, PRESETS)
  shape = mesh_shape(cfg.mesh, device_count)
  _validate_context(cfg, shape)
  _validate_stage(cfg, shape)
  return shape


def _validate_stage(cfg, shape):
  """Pipeline parallelism (jaxtrain/model/pipeline.py): the layers cut into stages x repeats equal
  parts, each batch into microbatches; what it does not run yet is refused."""
  s, m, t = shape["stage"], cfg.model, cfg.train
  r = m.pipeline_repeats
  if r < 1 or t.pipeline_microbatches < 0:
    raise ConfigError(f"model.pipeline_repeats must be >= 1 and train.pipeline_microbatches >= 0 "
                      f"(0 = one per stage), got {r} and {t.pipeline_microbatches}")
  if s == 1:
    return
  refused = [what for what, on in ((f"mesh.context={shape['context']}", shape["context"] > 1),
                                   (f"train.task={t.task}", t.task in ("grpo", "ppo")),
                                   ("model.attention=splash", m.attention == "splash")) if on]
  # rollouts: decoding through stages; splash: its backward pass does not type its cotangents as
  # varying over stages (auto takes blockwise or xla)
  if refused:
    raise ConfigError(f"mesh.stage={s} with {refused[0]}: the pipeline does not run it yet "
                      "(set --config.mesh.stage=1)")
  if m.n_layers % (s * r):
    raise ConfigError(f"model.n_layers={m.n_layers} does not divide into mesh.stage={s} x "
                      f"model.pipeline_repeats={r} equal parts")
  if m.n_experts:  # each stack of the decoder (transformer.layer_plan) is a pipeline of its own
    steps = (m.n_layers - m.moe_first_dense) // max(m.moe_every, 1)
    for what, n in ((f"model.moe_first_dense={m.moe_first_dense}", m.moe_first_dense),
                    (f"{steps} MoE scan steps (model.moe_every={m.moe_every})", steps)):
      if n % (s * r):
        raise ConfigError(f"{what}: does not divide into mesh.stage={s} x "
                          f"model.pipeline_repeats={r} equal parts")
  mb = t.pipeline_microbatches or s  # 0: one per stage
  if r > 1 and mb < s:
    raise ConfigError(f"circular repeats (model.pipeline_repeats={r}) need at least one microbatch "
                      f"per stage: train.pipeline_microbatches={mb} < mesh.stage={s}")
  data_ways = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"]
  auto = AUTO in (t.batch_size, t.microbatches)
  if not auto and t.batch_size % (data_ways * t.microbatches * mb):
    raise ConfigError(
        f"train.batch_size={t.batch_size} does not divide into {t.microbatches} microbatch(es) x "
        f"{mb} pipeline microbatches over the {data_ways} data-parallel devices")


def _validate_context(cfg, shape):
  """Context parallelism cuts each row into 2 x context chunks (causal load balance, Llama 3);
  with an explicit reduction: comm.validate_comm."""
  cp, t = shape["context"], cfg.train
  if cp == 1:
    return
  if t.seq_len % (2 * cp):
    raise ConfigError(f"train.seq_len={t.seq_len} does not divide into 2 x {cp} chunks for the "
                      f"context axis ({cp}); use a multiple of {2 * cp}")
  if cfg.model.n_experts:
    raise ConfigError(
        f"the context axis ({cp}) with experts: the experts' shard_map does not split "
        "the sequence yet (set --config.mesh.context=1)")
