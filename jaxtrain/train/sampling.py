"""Text continuation with a trained or converted model: `sample(workdir, prompt, ...)`.

Reads only what inference needs from the newest checkpoint: the config saved with it, params and the
non-trainable `extra` collections (Orbax partial restore: no optimizer state, no data item), placed
on one device with no mesh. The tokenizer is the run's (`data.make_tokenizer`; a converted model
carries its HF tokenizer). A masked LM (train.task=mlm) fills in the prompt's [MASK] markers
instead (`fill_masks`); a vlm run answers about an image file (`answer_image`).
"""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import config as config_lib, data
from jaxtrain.checkpoint import pretrained
from jaxtrain.core.mlm import mask_token
from jaxtrain.core.vlm import continue_with_image
from jaxtrain.data import image_text, shapes
from jaxtrain.data.text import ByteTokenizer
from jaxtrain.data.tokenizers import REF_FILE
from jaxtrain.model import Encoder, ModelConfig, Transformer, generate
from jaxtrain.model.vision import VisionLanguageModel

MASK_MARKER = "[MASK]"  # where a masked LM's prompt asks for a token


def sample(workdir: str, prompt: str | None, max_new_tokens: int, temperature: float, top_k: int,
           seed: int = 0, devices=None, image: str | None = None) -> str:
  """Text continuation of `prompt` (after the tokenizer's BOS) by the newest checkpoint of
  `workdir`, stopped after EOS; temperature 0 is greedy, top_k 0 samples from the whole
  vocabulary. A vlm run (train.task=vlm) answers about the PNG or JPEG file `image` instead
  (`answer_image`)."""
  _, step = pretrained.find_step(workdir)
  cfg, params, extra = pretrained.read_step(workdir, step)
  check_sampling(cfg.model, max_new_tokens, temperature, top_k)
  if cfg.train.task == "vlm":
    if image is None:
      raise config_lib.ConfigError("sample: a vlm run answers about an image: pass --image PATH "
                                   "(a PNG or JPEG file)")
    if not cfg.model.vision.freeze:
      vision = {}
    else:  # a frozen encoder is checkpointed in the task state
      vision = pretrained.load_task_state(workdir, step, "vision")
    return answer_image(cfg, {**params, **vision}, image, prompt, max_new_tokens, temperature,
                        top_k, seed, devices)
  if image is not None:
    raise config_lib.ConfigError(f"sample: --image is for a vlm run; {workdir} is "
                                 f"train.task={cfg.train.task}")
  tokenizer = load_tokenizer(cfg, workdir)
  if cfg.train.task == "mlm":
    return fill_masks(cfg, params, tokenizer, prompt, devices)
  try:
    prompt_ids = np.concatenate([[tokenizer.bos], tokenizer.encode(prompt)]).astype(np.int32)
  except ValueError as e:  # a symbol outside the synthetic language
    raise config_lib.ConfigError(str(e)) from e
  out = continue_ids(cfg.model, params, extra, prompt_ids, max_new_tokens, temperature, top_k, seed,
                     devices)
  if tokenizer.eos in out:  # stop at the end of the document
    out = out[: list(out).index(tokenizer.eos) + 1]
  return tokenizer.decode(out)


def answer_image(cfg, params, image: str, prompt: str | None, max_new_tokens: int,
                 temperature: float, top_k: int, seed: int = 0, devices=None) -> str:
  """A vlm run's text for the image file `image` (decoded, resized and normalized as its data was)
  after `prompt`: on the shapes data (no data.path) the answer to "shape?" or "colour?" (the
  default; one token, as the data's answers are), on image-text pairs the caption's continuation
  (default prompt: none), stopped at EOS."""
  v = config_lib.VisionConfig.from_config(cfg.model.vision)
  v = dataclasses.replace(v, image_token=config_lib.image_token(cfg.model))
  if cfg.data.path:
    tokenizer, prompt = ByteTokenizer(), prompt or ""
  else:
    tokenizer, prompt, max_new_tokens = shapes.ShapesTokenizer(), prompt or "shape?", 1
  try:
    pixels = image_text.load_image(image, v.image_size, v.channels)
  except image_text.BadImage as e:
    raise config_lib.ConfigError(f"sample: --image {image}: {e.reason.replace('_', ' ')}") from None
  try:
    text_ids = tokenizer.encode(prompt)
  except ValueError as e:
    raise config_lib.ConfigError(f"sample: {e}") from None
  prompt_ids = np.concatenate([[tokenizer.bos], [v.image_token] * v.patches, text_ids])
  if len(prompt_ids) + max_new_tokens > cfg.model.max_seq_len:
    raise config_lib.ConfigError(
        f"sample: the image ({v.patches} tokens) + prompt ({len(text_ids) + 1}) + max_new_tokens "
        f"({max_new_tokens}) exceed model.max_seq_len={cfg.model.max_seq_len}")
  model = VisionLanguageModel(ModelConfig.from_config(cfg.model), v)
  out = continue_with_image(model, params, pixels, prompt_ids.astype(np.int32), max_new_tokens,
                            float(temperature), int(top_k), seed, tokenizer.eos,
                            (devices or jax.local_devices())[0])
  return tokenizer.decode(out)


def continue_ids(model_cfg, params, extra, prompt_ids, max_new_tokens: int, temperature: float,
                 top_k: int, seed: int = 0, devices=None) -> np.ndarray:
  """The max_new_tokens ids that follow `prompt_ids` (1-d), generated on the first of `devices`
  (default: the first local device) by the model of `model_cfg` (a config's model section) with
  numpy params."""
  if len(prompt_ids) + max_new_tokens > model_cfg.max_seq_len:
    raise config_lib.ConfigError(
        f"sample: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
        f"exceeds model.max_seq_len={model_cfg.max_seq_len}")
  device = (devices or jax.local_devices())[0]
  model = Transformer(ModelConfig.from_config(model_cfg))
  params, extra, prompt_1P = jax.device_put(
      (params, extra, jnp.asarray(prompt_ids, jnp.int32)[None]), device)
  gen = jax.jit(generate, static_argnums=(0, 4, 5, 6))
  tokens_1N = gen(model, params, prompt_1P, jax.random.key(seed), max_new_tokens,
                  float(temperature), int(top_k), extra)
  return np.asarray(tokens_1N[0])


def fill_masks(cfg, params, tokenizer, prompt: str, devices=None) -> str:
  """The prompt with each [MASK] marker replaced by the masked LM's most likely token there, all at
  once from one forward pass of the encoder (greedy: max_new_tokens, temperature and top_k do not
  apply); nothing is added around the prompt's tokens."""
  pieces = prompt.split(MASK_MARKER)
  if len(pieces) == 1:
    raise config_lib.ConfigError(f"sample: a masked LM fills in {MASK_MARKER} markers; the prompt "
                                 f"{prompt!r} has none")
  mask_id, ids = mask_token(cfg), []
  try:
    for i, piece in enumerate(pieces):
      ids += ([mask_id] if i else []) + [int(t) for t in tokenizer.encode(piece)]
  except ValueError as e:  # a symbol outside the synthetic language
    raise config_lib.ConfigError(str(e)) from e
  if len(ids) > cfg.model.max_seq_len:
    raise config_lib.ConfigError(f"sample: the prompt is {len(ids)} tokens, more than "
                                 f"model.max_seq_len={cfg.model.max_seq_len}")
  device = (devices or jax.local_devices())[0]
  model = Encoder(ModelConfig.from_config(cfg.model))
  params, tokens_1L = jax.device_put((params, jnp.asarray(ids, jnp.int32)[None]), device)
  logits_1LV = jax.jit(model.apply)({"params": params}, tokens_1L)
  filled_L = jnp.where(tokens_1L[0] == mask_id, jnp.argmax(logits_1LV[0], axis=-1), tokens_1L[0])
  return tokenizer.decode(np.asarray(filled_L))


def check_sampling(model_cfg, max_new_tokens: int, temperature: float, top_k: int) -> None:
  """ConfigError (one line) for sampling arguments that cannot run on this model."""
  if max_new_tokens < 1:
    raise config_lib.ConfigError(f"sample: max_new_tokens={max_new_tokens} must be >= 1")
  if not (math.isfinite(temperature) and temperature >= 0):
    raise config_lib.ConfigError(
        f"sample: temperature={temperature} must be a finite number >= 0 (0: greedy)")
  if not 0 <= top_k <= model_cfg.vocab_size:
    raise config_lib.ConfigError(
        f"sample: top_k={top_k} must be in [0, vocab_size={model_cfg.vocab_size}] "
        "(0: the whole vocabulary)")


def load_tokenizer(cfg, workdir: str):
  """The run's tokenizer; ConfigError (one line) when it has none or its file is gone or changed."""
  if cfg.data.kind == "text" and not os.path.isfile(os.path.join(workdir, REF_FILE)):
    raise config_lib.ConfigError(
        f"{workdir} has no tokenizer (no {REF_FILE}; a model converted from a HF "
        "directory without tokenizer.json or tokenizer.model has none)")
  try:
    return data.make_tokenizer(cfg, workdir)
  except (FileNotFoundError, ValueError) as e:
    raise config_lib.ConfigError(f"{workdir}: {e}") from e
