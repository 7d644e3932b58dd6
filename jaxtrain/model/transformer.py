"""A Llama-style decoder: embedding, [RMSNorm -> GQA -> RMSNorm -> SwiGLU] x n_layers, norm, logits.

Layers are always stacked under `params/layers` with a leading `layers` axis (nn.scan), so the
scanned and the unrolled (`scan_layers=False`, scan fully unrolled) models share one parameter tree.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.collectives import constrain
from jaxtrain.config import ModelConfig
from jaxtrain.model import axes, context
from jaxtrain.model.attention import Attention, attention_mask
from jaxtrain.model.layers import RMSNorm, param
from jaxtrain.model.mlp import Mlp
from jaxtrain.model.moe import MoeMlp

REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class Block(nn.Module):
  """One pre-norm decoder layer (dense or MoE feed-forward); the scan body: returns (carry, MoE stats)."""
  cfg: ModelConfig
  decode: bool = False
  moe: bool = False

  @nn.compact
  def __call__(self, x_BLD, positions_BL, mask_BLS, valid_BL):
    c = self.cfg
    h_BLD = RMSNorm(c.norm_eps, c.param_dtype, name="attn_norm")(x_BLD)
    x_BLD = x_BLD + Attention(c, self.decode, name="attn")(h_BLD, positions_BL, mask_BLS)
    h_BLD = RMSNorm(c.norm_eps, c.param_dtype, name="mlp_norm")(x_BLD)
    stats = None
    if self.moe:
      y_BLD, stats = MoeMlp(c, name="moe")(h_BLD, valid_BL)
    else:
      y_BLD = Mlp(c, name="mlp")(h_BLD)
    return constrain(x_BLD + y_BLD, (axes.BATCH, axes.SEQ, axes.EMBED)), stats


class Group(nn.Module):
  """`moe_every` consecutive layers, the last with an MoE feed-forward (one scan step)."""
  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD, positions_BL, mask_BLS, valid_BL):
    k = self.cfg.moe_every
    for i in range(k):
      x_BLD, stats = Block(self.cfg, self.decode, moe=i == k - 1, name=f"block_{i}")(
          x_BLD, positions_BL, mask_BLS, valid_BL)
    return x_BLD, stats


def layer_plan(cfg: ModelConfig) -> list[tuple[str, str, int]]:
  """The scans of the decoder, in order: (parameter name, kind, length); kind is dense, moe or group.

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
                   length: int | None = None) -> nn.Module:
  """Blocks as one nn.scan, rematerialized by policy; the name fixes the parameter path."""
  block = Group if kind == "group" else Block
  if cfg.remat != "none":
    block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
  length = cfg.n_layers if length is None else length
  scanned = nn.scan(
      block,
      variable_axes={"params": 0, "cache": 0, "moe_state": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
      length=length,
      unroll=1 if cfg.scan_layers else length,
      metadata_params={nn.PARTITION_NAME: axes.LAYERS},
  )
  if kind == "group":
    return scanned(cfg, decode, name=name)
  return scanned(cfg, decode, kind == "moe", name=name)


class Transformer(nn.Module):
  """tokens [B, L] -> float32 logits [B, L, V]. Set `decode=True` to run with a KV cache."""
  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, indices_BL=None):
    c = self.cfg
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones_like(tokens_BL)
    embed_VD = param(self, "embed", (c.vocab_size, c.d_model), (axes.VOCAB, axes.EMBED), c.param_dtype, c.init_std)
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(c.compute_dtype)
    x_BLD = constrain(x_BLD, (axes.BATCH, axes.SEQ, axes.EMBED))
    mask_BLS = None
    # indices_BL: each token's place in its un-permuted row (context parallelism permutes rows; model/context.py)
    index_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape) if indices_BL is None else indices_BL
    if not self.decode and context.shards() > 1:  # [context parallelism] attention gets ids, not a [B, L, S] mask
      mask_BLS = (segment_ids_BL, index_BL)
    elif not self.decode:  # the cache builds its own mask
      mask_BLS = attention_mask(segment_ids_BL, segment_ids_BL, index_BL, index_BL)
    valid_BL = segment_ids_BL > 0
    for name, kind, length in layer_plan(c):
      x_BLD, stats = stacked_layers(c, self.decode, name, kind, length)(x_BLD, positions_BL, mask_BLS, valid_BL)
      if stats is not None:  # per-layer MoE statistics, [layers, ...], read by the train step
        self.sow("moe_stats", f"{name}_stats", stats)
    x_BLD = RMSNorm(c.norm_eps, c.param_dtype, name="final_norm")(x_BLD)
    if c.tie_embeddings:
      logits_BLV = jnp.einsum("BLD,VD->BLV", x_BLD, embed_VD.astype(c.compute_dtype),
                              preferred_element_type=jnp.float32)
    else:
      unembed_DV = param(self, "unembed", (c.d_model, c.vocab_size), (axes.EMBED, axes.VOCAB), c.param_dtype,
                         c.init_std)
      logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, unembed_DV.astype(c.compute_dtype),
                              preferred_element_type=jnp.float32)
    return constrain(logits_BLV, (axes.BATCH, axes.SEQ, axes.VOCAB))


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
  """Parameters by formula (embeddings included, once when tied); `active`: those one token uses."""
  attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
  per_layer = attn + 2 * c.d_model
  embed = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
  return c.n_layers * per_layer + _mlp_params(c, active) + embed + c.d_model


def active_mlp_params(c: ModelConfig) -> int:
  """Matmul parameters of the feed-forward layers that each token goes through (FLOP counting)."""
  return _mlp_params(c, active=True)
