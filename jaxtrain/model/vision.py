"""Image-text inputs, `train.task=vlm`: a ViT image encoder (Dosovitskiy et al., 2021), LLaVA's
2-layer GELU projector (Liu et al., 2023) and the decoder, whose placeholder tokens
(`model.vision.image_token`) take the projected patches in order.

The encoder cuts each image into (image_size / patch_size)^2 patches, embeds them with one dense
layer and a learned position table, and runs the encoder's blocks (model/encoder.py: bidirectional
`attend`, LayerNorm, GELU MLP, biases), not a fork of them; those blocks are post-norm, so the
encoder's output is normed already (a ViT with pre-norm blocks adds a final norm instead) and its
embeddings get a LayerNorm first, as BERT's. In the text, each image is as many placeholders as it
has patches: the k-th placeholder of a row takes the row's k-th patch (cumsum index, static shapes,
inside jit, as MaxText merges them). Arrays of images are named in full (`images`: [B, N, H, W, C]);
inside the encoder each image is a row (B) and its patches its length (L).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.collectives import constrain
from jaxtrain.config import ModelConfig, VisionConfig
from jaxtrain.model import axes
from jaxtrain.model.encoder import dense, encoder_layers
from jaxtrain.model.layers import LayerNorm, param
from jaxtrain.model.transformer import Transformer


def encoder_config(m: ModelConfig, v: VisionConfig) -> ModelConfig:
  """The image encoder's ModelConfig: the decoder's dtypes, init and remat, the vision section's
  sizes (MLP 4x wide), learned positions (the encoder adds its own table), attention chosen for a
  bidirectional encoder."""
  return dataclasses.replace(
      m, arch="encoder", d_model=v.d_model, n_layers=v.n_layers, n_heads=v.n_heads,
      n_kv_heads=v.n_heads, head_dim=v.d_model // v.n_heads, d_ff=4 * v.d_model,
      max_seq_len=v.patches, positions="learned", type_vocab_size=0, attention="auto",
      n_experts=0, fused_norm="off", fp8="off", lora_rank=0)


def patchify(images, patch: int):
  """images [B, N, H, W, C] -> [B * N, patches, patch * patch * C], patches in row-major order."""
  b, n, h, w, c = images.shape
  x = images.reshape(b * n, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b * n, (h // patch) * (w // patch), patch * patch * c)


class VisionEncoder(nn.Module):
  """images [B, N, H, W, C] -> patch features [B, N * patches, vision d_model], images in order."""
  cfg: ModelConfig  # encoder_config's
  vision: VisionConfig

  @nn.compact
  def __call__(self, images):
    c, v = self.cfg, self.vision
    b, n = images.shape[:2]
    x_BLI = patchify(images.astype(c.compute_dtype), v.patch_size)
    x_BLD = dense(self, "patch_embed", x_BLI, c.d_model, (None, axes.EMBED), c)
    table_LD = param(self, "position_embed", (v.patches, c.d_model), (None, axes.EMBED),
                     c.param_dtype, c.init_std)
    x_BLD = LayerNorm(c.norm_eps, c.param_dtype, name="embed_norm")(x_BLD + table_LD)
    x_BLD = constrain(x_BLD.astype(c.compute_dtype), (axes.BATCH, axes.SEQ, axes.EMBED))
    positions_BL = jnp.broadcast_to(jnp.arange(v.patches), x_BLD.shape[:2])
    x_BLD, _ = encoder_layers(c)(x_BLD, positions_BL, jnp.ones(x_BLD.shape[:2], jnp.int32))
    return x_BLD.reshape(b, n * v.patches, c.d_model)


class Projector(nn.Module):
  """LLaVA-1.5's projector: dense -> GELU -> dense, to the decoder's d_model."""
  cfg: ModelConfig  # the decoder's

  @nn.compact
  def __call__(self, x_BLE):
    c = self.cfg
    h_BLD = jax.nn.gelu(dense(self, "up", x_BLE, c.d_model, (axes.EMBED, axes.MLP), c),
                        approximate=False)
    return dense(self, "down", h_BLD, c.d_model, (axes.MLP, axes.EMBED), c)


def place(tokens_BL, features_BMD, image_token: int):
  """(overlay [B, L, D], where [B, L]): the k-th placeholder of each row gets the row's k-th feature
  (M = images x patches); placeholders past the M-th repeat the last (the data puts exactly M)."""
  where_BL = tokens_BL == image_token
  k_BL = jnp.clip(jnp.cumsum(where_BL, axis=1) - 1, 0, features_BMD.shape[1] - 1)
  return jnp.take_along_axis(features_BMD, k_BL[..., None], axis=1), where_BL


class VisionLanguageModel(nn.Module):
  """(tokens [B, L], images [B, N, H, W, C]) -> float32 logits [B, L, V]; params under `vision`,
  `projector` and `decoder` (a Transformer's tree). `vision.image_token` must be resolved (>= 0)."""
  cfg: ModelConfig
  vision: VisionConfig

  @nn.compact
  def __call__(self, tokens_BL, images, positions_BL=None, segment_ids_BL=None):
    c, v = self.cfg, self.vision
    features_BME = VisionEncoder(encoder_config(c, v), v, name="vision")(images)
    features_BMD = Projector(c, name="projector")(features_BME)
    overlay_BLD, where_BL = place(tokens_BL, features_BMD, v.image_token)
    overlay_BLD = constrain(overlay_BLD, (axes.BATCH, axes.SEQ, axes.EMBED))
    return Transformer(c, name="decoder")(tokens_BL, positions_BL, segment_ids_BL,
                                          overlay_BLD=overlay_BLD, overlay_BL=where_BL)


def vision_param_count(m: ModelConfig, v: VisionConfig) -> int:
  """Parameters of the encoder and projector of VisionLanguageModel(m, v), by formula (the decoder
  is transformer.param_count(m))."""
  d, n, k, f = v.d_model, v.n_heads, v.d_model // v.n_heads, 4 * v.d_model
  attn = d * k * 4 * n + k * 3 * n + d  # q, k, v, o and their biases
  per_layer = attn + 2 * d * f + f + d + 4 * d  # MLP with biases, two LayerNorms
  embed = v.patch_size ** 2 * v.channels * d + d + v.patches * d + 2 * d
  projector = d * m.d_model + m.d_model + m.d_model ** 2 + m.d_model
  return embed + v.n_layers * per_layer + projector
