"""A BERT encoder (Devlin et al., 2019) with its masked-LM head, `model.arch=encoder`:
embeddings (word + learned position + token type, LayerNorm), [attention -> add & LayerNorm -> GELU
MLP -> add & LayerNorm] x n_layers (post-norm, biases everywhere), then the head: dense, GELU,
LayerNorm and the word embeddings as decoder, with a bias. Attention is bidirectional within each
document (`attend(causal=False)`: segment ids, no causal order). `model.positions=rope` puts rotary
positions on q and k instead of the position table.

Its own module rather than switches in transformer.py's Block: five of BERT's differences (norm
kind, norm place, biases, activation, embeddings) would each branch the decoder that every other
task trains, and the decoder's fused norm, MoE, fp8, pipeline and KV-cache paths do not apply to it.
With BERT's settings it computes transformers' BertForMaskedLM (checkpoint/hf_bert.py,
tests/checkpoint/test_hf_bert.py). Layers are stacked under `params/layers` like the decoder's.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.collectives import constrain
from jaxtrain.config import ModelConfig
from jaxtrain.model import axes
from jaxtrain.model.attention import attend
from jaxtrain.model.layers import LayerNorm, param, rope

# transformer.REMAT_POLICIES, written again: transformer.py imports this module (param_count)
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def bias(module: nn.Module, name: str, shape, names, dtype):
  """A zero-initialized bias with logical axis names."""
  return module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, names), shape,
                      dtype)


def dense(module: nn.Module, name: str, x_BLI, n_out: int, names, c: ModelConfig):
  """x @ w + b, w [in, out] with logical `names` (in, out), the product in compute_dtype."""
  w = param(module, name, (x_BLI.shape[-1], n_out), names, c.param_dtype, c.init_std)
  b = bias(module, f"{name}_bias", (n_out,), names[1:], c.param_dtype)
  cd = c.compute_dtype
  return jnp.einsum("BLI,IO->BLO", x_BLI.astype(cd), w.astype(cd)) + b.astype(cd)


class EncoderAttention(nn.Module):
  """Multi-head (or grouped-query) self-attention with biased projections, bidirectional."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL):
    c = self.cfg
    pd, cd = c.param_dtype, c.compute_dtype
    heads = {"q": (c.n_heads, axes.HEADS), "k": (c.n_kv_heads, axes.KV_HEADS),
             "v": (c.n_kv_heads, axes.KV_HEADS)}
    x_BLD = x_BLD.astype(cd)
    out = {}
    for name, (n, axis) in heads.items():
      w_DNK = param(self, name, (c.d_model, n, c.head_dim), (axes.EMBED, axis, axes.HEAD_DIM), pd,
                    c.init_std)
      b_NK = bias(self, f"{name}_bias", (n, c.head_dim), (axis, axes.HEAD_DIM), pd)
      y_BLNK = jnp.einsum("BLD,DNK->BLNK", x_BLD, w_DNK.astype(cd)) + b_NK.astype(cd)
      if name != "v" and c.positions == "rope":
        y_BLNK = rope(y_BLNK, positions_BL, c)
      out[name] = constrain(y_BLNK, (axes.BATCH, axes.SEQ, axis, axes.HEAD_DIM))
    o_BLHK = attend(out["q"], out["k"], out["v"], segment_ids_BL, segment_ids_BL, None, None, c,
                    causal=False)
    w_o = param(self, "o", (c.n_heads, c.head_dim, c.d_model),
                (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pd, c.init_std)
    b_o = bias(self, "o_bias", (c.d_model,), (axes.EMBED,), pd)
    return jnp.einsum("BLHK,HKD->BLD", o_BLHK, w_o.astype(cd)) + b_o.astype(cd)


class EncoderBlock(nn.Module):
  """One post-norm BERT layer; the scan body: returns (carry, None)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL):
    c = self.cfg
    a_BLD = EncoderAttention(c, name="attn")(x_BLD, positions_BL, segment_ids_BL)
    x_BLD = LayerNorm(c.norm_eps, c.param_dtype, name="attn_norm")(x_BLD + a_BLD)
    mlp = EncoderMlp(c, name="mlp")
    x_BLD = LayerNorm(c.norm_eps, c.param_dtype, name="mlp_norm")(x_BLD + mlp(x_BLD))
    return constrain(x_BLD, (axes.BATCH, axes.SEQ, axes.EMBED)), None


class EncoderMlp(nn.Module):
  """dense -> GELU (exact, erf) -> dense, with biases."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    h_BLF = jax.nn.gelu(dense(self, "up", x_BLD, c.d_ff, (axes.EMBED, axes.MLP), c),
                        approximate=False)
    h_BLF = constrain(h_BLF, (axes.BATCH, axes.SEQ, axes.MLP))
    return dense(self, "down", h_BLF, c.d_model, (axes.MLP, axes.EMBED), c)


def encoder_layers(c: ModelConfig, name: str = "layers") -> nn.Module:
  """The n_layers EncoderBlocks as one nn.scan under `name` (remat by policy), to be applied to
  (x_BLD, positions_BL, segment_ids_BL); the vision encoder (model/vision.py) stacks them too."""
  block = EncoderBlock
  if c.remat != "none":
    block = nn.remat(block, policy=REMAT_POLICIES[c.remat], prevent_cse=False)
  layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast, nn.broadcast), length=c.n_layers,
                   unroll=1 if c.scan_layers else c.n_layers,
                   metadata_params={nn.PARTITION_NAME: axes.LAYERS})
  return layers(c, name=name)


class Encoder(nn.Module):
  """tokens [B, L] -> float32 masked-LM logits [B, L, V] (the encoder's hidden states [B, L, D]
  with `return_hidden`).

  `positions_BL` None: arange; `segment_ids_BL` (0 = padding) None: one document per row;
  `token_types_BL` None: type 0 (BERT's sentence A)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, token_types_BL=None,
               return_hidden=False):
    c = self.cfg
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    embed_VD = param(self, "embed", (c.vocab_size, c.d_model), (axes.VOCAB, axes.EMBED),
                     c.param_dtype, c.init_std)
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0)
    if c.positions == "learned":
      table_PD = param(self, "position_embed", (c.max_seq_len, c.d_model), (None, axes.EMBED),
                       c.param_dtype, c.init_std)
      x_BLD = x_BLD + jnp.take(table_PD, positions_BL, axis=0)
    if c.type_vocab_size:
      types_TD = param(self, "type_embed", (c.type_vocab_size, c.d_model), (None, axes.EMBED),
                       c.param_dtype, c.init_std)
      types_BL = jnp.zeros_like(tokens_BL) if token_types_BL is None else token_types_BL
      x_BLD = x_BLD + jnp.take(types_TD, types_BL, axis=0)
    x_BLD = LayerNorm(c.norm_eps, c.param_dtype, name="embed_norm")(x_BLD).astype(c.compute_dtype)
    x_BLD = constrain(x_BLD, (axes.BATCH, axes.SEQ, axes.EMBED))
    x_BLD, _ = encoder_layers(c)(x_BLD, positions_BL, segment_ids_BL)
    if return_hidden:
      return x_BLD
    h_BLD = jax.nn.gelu(dense(self, "head", x_BLD, c.d_model, (axes.EMBED, None), c),
                        approximate=False)
    h_BLD = LayerNorm(c.norm_eps, c.param_dtype, name="head_norm")(h_BLD)
    out_bias_V = bias(self, "output_bias", (c.vocab_size,), (axes.VOCAB,), c.param_dtype)
    logits_BLV = jnp.einsum("BLD,VD->BLV", h_BLD, embed_VD.astype(c.compute_dtype),
                            preferred_element_type=jnp.float32) + out_bias_V.astype(jnp.float32)
    return constrain(logits_BLV, (axes.BATCH, axes.SEQ, axes.VOCAB))


def encoder_param_count(c: ModelConfig) -> int:
  """Parameters of Encoder(c) by formula (the decoder of the head is the word embedding)."""
  d = c.d_model
  attn = d * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads) + c.head_dim * (
      c.n_heads + 2 * c.n_kv_heads) + d
  mlp = 2 * d * c.d_ff + c.d_ff + d
  per_layer = attn + mlp + 4 * d  # two LayerNorms
  positions = c.max_seq_len * d if c.positions == "learned" else 0
  embed = c.vocab_size * d + positions + c.type_vocab_size * d + 2 * d
  head = d * d + d + 2 * d + c.vocab_size
  return embed + c.n_layers * per_layer + head
