"""Image-text training, `train.task=vlm`: the decoder of `cfg.model` reads text whose image
placeholders (`model.vision.image_token`) carry a ViT's projected patches (model/vision.py), and is
trained by next-token cross-entropy on text targets only (placeholders and padding masked, and
what the data's `loss_mask` leaves out); accuracy on those tokens is logged too.

Batches: `inputs`, `targets`, `segment_ids`, `positions`, `loss_mask` as the language model's, and
`images` [B, N, H, W, C] float32 (normalized), N images a row of `patches` placeholders each. The
source is the generated shapes task (data/shapes.py), or with data.path the image-text pairs of a
JSONL file (data/image_text.py: PNG/JPEG by Pillow; bad images counted and skipped). With
`model.vision.freeze` the encoder's params sit in the task state (no gradient, no optimizer state,
no weight decay; checkpointed with it), and a run started from `checkpoint.init_from` reads them
from the checkpoint's params.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain.core.lm import cross_entropy
from jaxtrain.core.task import Task
from jaxtrain.data import image_text, shapes
from jaxtrain.data.text import BYTE_VOCAB
from jaxtrain.model import ModelConfig, param_count
from jaxtrain.model.decode import sample_token
from jaxtrain.model.vision import VisionLanguageModel, vision_param_count


def check_data(path: str, v, seq_len: int) -> None:
  """ConfigError (one line) when the data (image-text pairs at `path`, or the shapes task) cannot
  hold the placeholder `v.image_token`, `v.channels` or a row's image in seq_len."""
  first, emits = (BYTE_VOCAB, "the byte text of image-text pairs") if path else (
      shapes.VOCAB, "the shapes data")
  if v.image_token < first:
    raise config_lib.ConfigError(
        f"model.vision.image_token={v.image_token} is an id {emits} emits (0..{first - 1}): "
        "choose one above, or -1 (model.vocab_size - 1)")
  if v.channels not in ((1, 3) if path else (3,)):
    kinds = "images are RGB (3) or grey (1)" if path else "the shapes data is RGB (3)"
    raise config_lib.ConfigError(f"model.vision.channels={v.channels}: {kinds}")
  need = v.patches + 2 if path else shapes.row_length(v.patches)
  if seq_len < need:
    raise config_lib.ConfigError(
        f"train.seq_len={seq_len} is shorter than a row's image: {need} tokens ({v.patches} image "
        "placeholders, BOS and one text token)")


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def _next_token(model, params, tokens_1T, images, i, rng, temperature: float, top_k: int):
  logits_1TV = model.apply({"params": params}, tokens_1T, images)
  return sample_token(jax.lax.dynamic_index_in_dim(logits_1TV, i - 1, axis=1, keepdims=False), rng,
                      temperature, top_k)


def continue_with_image(model: VisionLanguageModel, params, image, prompt_ids, max_new_tokens: int,
                        temperature: float, top_k: int, seed: int = 0, stop: int | None = None,
                        device=None) -> np.ndarray:
  """The ids that follow `prompt_ids` (1-d: BOS, the image's placeholders, the prompt's text) with
  `image` ([H, W, C], normalized) in the placeholders, up to max_new_tokens or through `stop`;
  temperature 0 is greedy. Each token is one forward pass over the whole fixed-length row (no KV
  cache: one compiled program for every call of a model and row length; a VLM's answers are
  short)."""
  n = len(prompt_ids)
  tokens_1T = np.zeros((1, n + max_new_tokens), np.int32)
  tokens_1T[0, :n] = prompt_ids
  device = device or jax.local_devices()[0]
  params, images = jax.device_put((params, jnp.asarray(image, jnp.float32)[None, None]), device)
  out, rng = [], jax.random.key(seed)
  for i in range(n, n + max_new_tokens):
    rng, key = jax.random.split(rng)
    token = int(_next_token(model, params, tokens_1T, images, i, key, temperature, top_k)[0])
    tokens_1T[0, i] = token
    out.append(token)
    if token == stop:
      break
  return np.asarray(out, np.int32)


class VisionLanguage(Task):
  """Answer questions about images (the shapes data), or caption them (image-text pairs from the
  JSONL file data.path), with the VLM of `cfg.model`."""

  def __init__(self, cfg, workdir: str):
    del workdir
    self.cfg, t = cfg, cfg.train
    v = config_lib.VisionConfig.from_config(cfg.model.vision)
    self.vision = dataclasses.replace(v, image_token=config_lib.image_token(cfg.model))
    self.model = VisionLanguageModel(ModelConfig.from_config(cfg.model), self.vision)
    check_data(cfg.data.path, self.vision, t.seq_len)
    self._pairs = None
    self.batch_size, self.seq_len = t.batch_size, t.seq_len
    self.tokens_per_batch = t.batch_size * t.seq_len

  def init(self, rng):
    v = self.vision
    images = jnp.zeros((1, 1, v.image_size, v.image_size, v.channels), jnp.float32)
    params = self.model.init(rng, jnp.zeros((1, self.seq_len), jnp.int32), images)["params"]
    if not v.freeze:
      return params, {}, {}
    return {k: p for k, p in params.items() if k != "vision"}, {}, {"vision": params["vision"]}

  def init_from(self, params, task_state, load):
    """The checkpoint's params; a frozen encoder is read from them too."""
    if not self.vision.freeze:
      return load(params), task_state
    loaded = load({**params, "vision": task_state["vision"]})
    return {k: p for k, p in loaded.items() if k != "vision"}, {"vision": loaded["vision"]}

  def _sums(self, params, batch, task_state, z_loss: float):
    """(ce, z, text targets, correct) sums over the scored targets."""
    logits_BLV = self.model.apply({"params": {**params, **task_state}}, batch["inputs"],
                                  batch["images"], batch["positions"], batch["segment_ids"])
    text_BL = (batch["targets"] != self.vision.image_token) & (batch["segment_ids"] > 0)
    mask_BL = batch["loss_mask"] * text_BL
    ce, z, count = cross_entropy(logits_BLV, batch["targets"], mask_BL, z_loss)
    hit_BL = jnp.argmax(logits_BLV, axis=-1) == batch["targets"]
    return ce, z, count, jnp.sum(hit_BL * mask_BL)

  def loss(self, params, batch, extra, task_state):
    del extra
    ce, z, count, correct = self._sums(params, batch, task_state, self.cfg.train.z_loss)
    return ce + z, {"ce": ce, "z": z, "correct": correct, "count": count}

  def metrics(self, sums, parts):
    count = sums["count"]
    return {"loss": sums["ce"] / count, "z_loss": sums["z"] / count,
            "accuracy": sums["correct"] / count, "text_tokens": count}

  def eval_sums(self, params, extra, task_state, batch):
    del extra
    ce, _, count, correct = self._sums(params, batch, task_state, 0.0)
    return {"ce": ce, "count": count, "correct": correct}

  def eval_metrics(self, sums):
    """Means over the scored tokens of the held-out eval rows."""
    count = max(sum(float(s["count"]) for s in sums), 1.0)
    return {"eval_loss": sum(float(s["ce"]) for s in sums) / count,
            "eval_accuracy": sum(float(s["correct"]) for s in sums) / count}

  def batches(self, split, lo, hi):
    v = self.vision
    if self.cfg.data.path:
      return image_text.PairBatches(image_text.split_pairs(self.pairs(), split), lo, hi,
                                    self.batch_size, self.seq_len, v.patches, v.image_token,
                                    v.image_size, v.channels)
    return shapes.ShapeBatches(self.cfg.train.seed, split, lo, hi, self.batch_size, self.seq_len,
                               v.image_size, v.patches, v.image_token)

  def pairs(self) -> list:
    """data.path's image-text pairs (paths and captions), read once; the bad ones counted in one
    printed line."""
    if self._pairs is None:
      path = self.cfg.data.path
      self._pairs, counts = image_text.read_pairs(path)
      print(image_text.report(path, len(self._pairs), counts), flush=True)
      if not self._pairs:
        raise config_lib.ConfigError(f"data.path={path}: no usable image-text pair")
    return self._pairs

  def sizes(self):
    n = param_count(self.model.cfg) + vision_param_count(self.model.cfg, self.vision)
    return {"params": n, "active_params": n}
