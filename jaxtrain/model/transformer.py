"""A Llama-style decoder: embedding, [RMSNorm -> GQA -> RMSNorm -> SwiGLU] x n_layers, norm, logits.

Layers are always stacked under `params/layers` with a leading `layers` axis (nn.scan), so the
scanned and the unrolled (`scan_layers=False`, scan fully unrolled) models share one parameter tree.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain import collectives
from jaxtrain.collectives import constrain, logical_spec
from jaxtrain.config import ModelConfig
from jaxtrain.kernels.rms_norm import ops as rms_norm_ops
from jaxtrain.model import axes, moe as moe_lib, pipeline
from jaxtrain.model.attention import Attention
from jaxtrain.model.encoder import encoder_param_count
from jaxtrain.model.layers import RMSNorm, param
from jaxtrain.model.mlp import Mlp
from jaxtrain.model.moe import MoeMlp

REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
# Each layer's input, named for train.offload=activations: the one residual of a layer under remat
# full, and the stack of them over the layers is what the scan keeps for the backward pass
LAYER_INPUT = "layer_input"


def remat_policy(remat: str, offload: bool):
  """The remat policy of model.remat; `offload`: each layer's input goes to pinned host memory
  (and comes back for the layer's backward pass) instead of staying on the device."""
  base = REMAT_POLICIES[remat]
  if not offload:
    return base
  to_host = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
      offload_src="device", offload_dst="pinned_host")

  def policy(prim, *args, **params):
    if prim.name == "name" and params["name"] == LAYER_INPUT:
      return to_host(prim, *args, **params)
    return base(prim, *args, **params)
  return policy


class AddRMSNorm(nn.Module):
  """residual + x, then RMSNorm, as one op (jaxtrain/kernels/rms_norm) of implementation `impl`:
  (normed, sum). Its parameter is RMSNorm's ("scale", ones), so either module reads the same
  checkpoint."""
  eps: float
  param_dtype: jnp.dtype
  impl: str

  @nn.compact
  def __call__(self, x_BLD, residual_BLD):
    scale_D = param(self, "scale", (x_BLD.shape[-1],), (axes.EMBED,), self.param_dtype, None)
    return rms_norm_ops.add_rms_norm(x_BLD, residual_BLD, scale_D, self.eps, impl=self.impl,
                                     tokens=logical_spec((axes.BATCH, axes.SEQ)))


class Block(nn.Module):
  """One pre-norm decoder layer (dense or MoE feed-forward); the scan body: returns
  (carry, MoE stats). `stat_sums`: the MoE stats as sums over tokens (MoeMlp's finish=False)."""
  cfg: ModelConfig
  decode: bool = False
  moe: bool = False
  stat_sums: bool = False

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, index_BL, valid_BL, branch_ids_BL=None):
    c = self.cfg
    x_BLD = checkpoint_name(x_BLD, LAYER_INPUT)
    h_BLD = RMSNorm(c.norm_eps, c.param_dtype, name="attn_norm")(x_BLD)
    a_BLD = Attention(c, self.decode, name="attn")(h_BLD, positions_BL, segment_ids_BL, index_BL,
                                                   branch_ids_BL)
    if c.fused_norm == "off":
      x_BLD = x_BLD + a_BLD
      h_BLD = RMSNorm(c.norm_eps, c.param_dtype, name="mlp_norm")(x_BLD)
    else:
      h_BLD, x_BLD = AddRMSNorm(c.norm_eps, c.param_dtype, c.fused_norm, name="mlp_norm")(a_BLD,
                                                                                          x_BLD)
    stats = None
    if self.moe:
      y_BLD, stats = MoeMlp(c, not self.stat_sums, name="moe")(h_BLD, valid_BL)
    else:
      y_BLD = Mlp(c, name="mlp")(h_BLD)
    return constrain(x_BLD + y_BLD, (axes.BATCH, axes.SEQ, axes.EMBED)), stats


class Group(nn.Module):
  """`moe_every` consecutive layers, the last with an MoE feed-forward (one scan step)."""
  cfg: ModelConfig
  decode: bool = False
  stat_sums: bool = False

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, index_BL, valid_BL, branch_ids_BL=None):
    k = self.cfg.moe_every
    for i in range(k):
      x_BLD, stats = Block(self.cfg, self.decode, moe=i == k - 1, stat_sums=self.stat_sums,
                           name=f"block_{i}")(
          x_BLD, positions_BL, segment_ids_BL, index_BL, valid_BL, branch_ids_BL)
    return x_BLD, stats


def layer_plan(cfg: ModelConfig) -> list[tuple[str, str, int]]:
  """The scans of the decoder, in order: (parameter name, kind, length); kind is dense, moe or
  group.

  Dense model: [("layers", "dense", n_layers)]. MoE: the first `moe_first_dense` layers under
  `dense_layers`, then under `layers` either every layer MoE or groups of `moe_every` layers."""
  if not cfg.n_experts:
    return [("layers", "dense", cfg.n_layers)]
  plan = [("dense_layers", "dense", cfg.moe_first_dense)] if cfg.moe_first_dense else []
  rest = cfg.n_layers - cfg.moe_first_dense
  if cfg.moe_every == 1:
    return plan + [("layers", "moe", rest)]
  return plan + [("layers", "group", rest // cfg.moe_every)]


def stacked_layers(cfg: ModelConfig, decode: bool, name: str = "layers", kind: str = "dense",
                   length: int | None = None, offload: bool = False, **module_args) -> nn.Module:
  """Blocks as one nn.scan, rematerialized by policy (`offload`: each layer's input kept in host
  memory, remat_policy); the name fixes the parameter path. `module_args`: the module's own
  (parent=None for one applied on its own)."""
  block = Group if kind == "group" else Block
  if cfg.remat != "none":
    block = nn.remat(block, policy=remat_policy(cfg.remat, offload), prevent_cse=False)
  length = cfg.n_layers if length is None else length
  scanned = nn.scan(
      block,
      variable_axes={"params": 0, "cache": 0, "moe_state": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,) * 5,
      length=length,
      unroll=1 if cfg.scan_layers else length,
      metadata_params={nn.PARTITION_NAME: axes.LAYERS},
  )
  if kind == "group":
    return scanned(cfg, decode, name=name, **module_args)
  return scanned(cfg, decode, kind == "moe", name=name, **module_args)


class Transformer(nn.Module):
  """tokens [B, L] -> float32 logits [B, L, V]. Set `decode=True` to run with a KV cache.

  `segment_ids_BL` (0 = padding) None: one document per row. `indices_BL`: each token's place in its
  un-permuted row, which orders attention causally (context parallelism permutes rows); None:
  arange. `branch_ids_BL` (None: none): documents that branch after a shared prefix, 0 on the
  prefix, b > 0 on branch b, which only branch b's later tokens see (eval/score.py scores a
  context's continuations in one document; attention.branched_attention). `return_hidden`: the
  final-normed hidden states [B, L, D] instead of the logits, for a loss that fuses the output
  projection (jaxtrain/kernels/cross_entropy; the head weight is `embed` or `unembed`).
  `overlay_BLD`: embeddings that replace the tokens' where `overlay_BL` is True (model/vision.py's
  projected image patches).

  With the `layers` axis split over a mesh axis (mesh.stage), training passes run the layers as a
  pipeline of `pipeline_microbatches` microbatches (0 = one per stage; jaxtrain/model/pipeline.py);
  init and decoding run them one after another, with the same parameters. `offload_activations`
  (train.offload=activations): each layer's input saved for the backward pass in host memory."""
  cfg: ModelConfig
  decode: bool = False
  pipeline_microbatches: int = 0
  offload_activations: bool = False

  @nn.compact
  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, indices_BL=None,
               return_hidden=False, overlay_BLD=None, overlay_BL=None, branch_ids_BL=None):
    c = self.cfg
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    embed_VD = param(self, "embed", (c.vocab_size, c.d_model), (axes.VOCAB, axes.EMBED),
                     c.param_dtype, c.init_std)
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(c.compute_dtype)
    if overlay_BLD is not None:  # a VLM's image patches in place of their placeholder tokens
      x_BLD = jnp.where(overlay_BL[..., None], overlay_BLD.astype(c.compute_dtype), x_BLD)
    x_BLD = constrain(x_BLD, (axes.BATCH, axes.SEQ, axes.EMBED))
    valid_BL = jnp.ones(tokens_BL.shape, bool) if segment_ids_BL is None else segment_ids_BL > 0
    rows_BL = {"positions": positions_BL, "segment_ids": segment_ids_BL, "indices": indices_BL,
               "valid": valid_BL, "branch_ids": branch_ids_BL}
    pipelined = not self.decode and not self.is_initializing() and pipeline.stage_axis()
    for name, kind, length in layer_plan(c):  # the cache makes its own indices when decoding
      if pipelined:
        x_BLD, stats = self._pipeline(name, kind, length, x_BLD, rows_BL)
      else:
        x_BLD, stats = stacked_layers(c, self.decode, name, kind, length,
                                      self.offload_activations and not self.decode)(
            x_BLD, positions_BL, segment_ids_BL, indices_BL, valid_BL, branch_ids_BL)
      if stats is not None:  # per-layer MoE statistics, [layers, ...], read by the train step
        self.sow("moe_stats", f"{name}_stats", stats)
    x_BLD = RMSNorm(c.norm_eps, c.param_dtype, name="final_norm")(x_BLD)
    if return_hidden:
      if not c.tie_embeddings:  # created all the same: one parameter tree whatever the caller asks
        param(self, "unembed", (c.d_model, c.vocab_size), (axes.EMBED, axes.VOCAB), c.param_dtype,
              c.init_std)
      return x_BLD
    if c.tie_embeddings:
      logits_BLV = jnp.einsum("BLD,VD->BLV", x_BLD, embed_VD.astype(c.compute_dtype),
                              preferred_element_type=jnp.float32)
    else:
      unembed_DV = param(self, "unembed", (c.d_model, c.vocab_size), (axes.EMBED, axes.VOCAB),
                         c.param_dtype, c.init_std)
      logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, unembed_DV.astype(c.compute_dtype),
                              preferred_element_type=jnp.float32)
    return constrain(logits_BLV, (axes.BATCH, axes.SEQ, axes.VOCAB))

  def _pipeline(self, name: str, kind: str, length: int, x_BLD, rows_BL: dict):
    """The stack `name` of `length` layers as a pipeline over the stage axis: (y, its per-layer MoE
    stats or None), the stats of the whole batch (the microbatches' sums, finished after)."""
    c = self.cfg
    stages = collectives.axis_size(pipeline.stage_axis())
    moe_args = {} if kind == "dense" else {"stat_sums": True}
    layers = stacked_layers(c, False, name, kind, length // (stages * c.pipeline_repeats),
                            parent=None, **moe_args)
    variables = {k: nn.unbox(v[name]) for k, v in self.variables.items()
                 if k in ("params", "moe_state") and name in v}

    def stage_fn(variables, x_bLD, rows_bL):
      return layers.apply(variables, x_bLD, rows_bL["positions"], rows_bL.get("segment_ids"),
                          rows_bL.get("indices"), rows_bL["valid"], rows_bL.get("branch_ids"))

    y_BLD, sums = pipeline.pipeline(stage_fn, variables, x_BLD,
                                    {k: v for k, v in rows_BL.items() if v is not None},
                                    repeats=c.pipeline_repeats,
                                    microbatches=self.pipeline_microbatches or stages,
                                    remat=c.remat != "none")
    return y_BLD, None if sums is None else jax.vmap(lambda t: moe_lib.finish_stats(t, c))(sums)


def _mlp_params(c: ModelConfig, active: bool) -> int:
  """Feed-forward parameters of all layers (routed experts: only the top-k when `active`)."""
  dense = 3 * c.d_model * c.d_ff
  if not c.n_experts:
    return c.n_layers * dense
  n_moe = sum(length for _, kind, length in layer_plan(c) if kind != "dense")  # a group has one
  routed = (c.top_k if active else c.n_experts) * 3 * c.d_model * c.expert_d_ff
  shared = c.n_shared_experts * 3 * c.d_model * c.expert_d_ff
  router = c.d_model * c.n_experts
  return (c.n_layers - n_moe) * dense + n_moe * (routed + shared + router)


def param_count(c: ModelConfig, active: bool = False) -> int:
  """Parameters by formula (embeddings included, once when tied); `active`: those one token uses.
  The encoder's (model.arch=encoder): model/encoder.py."""
  if c.arch == "encoder":
    return encoder_param_count(c)
  attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
  per_layer = attn + 2 * c.d_model
  embed = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
  return c.n_layers * per_layer + _mlp_params(c, active) + embed + c.d_model


def active_mlp_params(c: ModelConfig) -> int:
  """Matmul parameters of the feed-forward layers that each token goes through (FLOP counting)."""
  if c.arch == "encoder":  # up and down, no gate
    return c.n_layers * 2 * c.d_model * c.d_ff
  return _mlp_params(c, active=True)
