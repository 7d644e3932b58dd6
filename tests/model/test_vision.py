"""The VLM (model/vision.py): placeholders take the projected patches in order inside jit, an
image reaches the text only through its placeholders and only after them (causal decoder), and
every vision parameter has logical axis names."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config import ModelConfig, VisionConfig
from jaxtrain.model import axes
from jaxtrain.model.vision import VisionLanguageModel, patchify, place

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                    d_ff=64, max_seq_len=32)
VISION = VisionConfig(image_size=8, patch_size=4, d_model=16, n_layers=1, n_heads=2,
                      image_token=31)


def test_placeholders_take_the_patches_in_order_under_jit():
  tokens_BL = jnp.array([[1, 31, 31, 5, 31, 31, 0], [1, 2, 31, 31, 31, 31, 3]])
  features_BMD = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
  overlay_BLD, where_BL = jax.jit(place, static_argnums=2)(tokens_BL, features_BMD, 31)
  for b in range(2):
    np.testing.assert_array_equal(overlay_BLD[b][where_BL[b]], features_BMD[b])
  np.testing.assert_array_equal(where_BL, tokens_BL == 31)


def test_patchify_cuts_row_major_patches():
  images = jnp.arange(1 * 1 * 8 * 8 * 1, dtype=jnp.float32).reshape(1, 1, 8, 8, 1)
  patches = patchify(images, 4)
  assert patches.shape == (1, 4, 16)
  np.testing.assert_array_equal(patches[0, 1], images[0, 0, :4, 4:, 0].reshape(-1))
  np.testing.assert_array_equal(patches[0, 2], images[0, 0, 4:, :4, 0].reshape(-1))


def _logits(params, model, tokens_BL, images):
  return jax.jit(model.apply)({"params": params}, tokens_BL, images)


def test_an_image_reaches_the_text_through_its_placeholders_after_them():
  model = VisionLanguageModel(MODEL, VISION)
  tokens_BL = jnp.array([[1, 2, 31, 31, 31, 31, 3, 4]])
  images = jax.random.normal(jax.random.key(1), (1, 1, 8, 8, 3))
  params = nn.unbox(model.init(jax.random.key(0), tokens_BL, images)["params"])
  a = _logits(params, model, tokens_BL, images)
  b = _logits(params, model, tokens_BL, images + 1.0)
  np.testing.assert_array_equal(a[:, :2], b[:, :2])  # before the first placeholder: untouched
  assert np.abs(np.asarray(a[:, 2:] - b[:, 2:])).min(axis=-1).max() > 1e-4
  # no placeholder: the image is not seen at all
  plain = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]])
  np.testing.assert_array_equal(_logits(params, model, plain, images),
                                _logits(params, model, plain, images * 0))


def test_every_vision_parameter_has_logical_names():
  model = VisionLanguageModel(MODEL, dataclasses.replace(VISION, n_layers=2))
  boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
                         jnp.zeros((1, 1, 8, 8, 3)))["params"]
  assert set(boxed) == {"vision", "projector", "decoder"}
  for part in ("vision", "projector"):
    leaves = jax.tree.leaves(boxed[part], is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
    for x in leaves:
      assert len(x.names) == len(x.value.shape) and set(x.names) - {None} <= set(axes.ALL)
  assert boxed["vision"]["layers"]["attn"]["q"].names[0] == axes.LAYERS
