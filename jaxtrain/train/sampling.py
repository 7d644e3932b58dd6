"""Text continuation with a trained or converted model: `sample(workdir, prompt, ...)`.

Reads only what inference needs from the newest checkpoint: the config saved with it, params and the
non-trainable `extra` collections (Orbax partial restore: no optimizer state, no data item), placed
on one device with no mesh. The tokenizer is the run's (`data.make_tokenizer`; a converted model
carries its HF tokenizer).
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import config as config_lib, data
from jaxtrain.checkpoint import pretrained
from jaxtrain.data.tokenizers import REF_FILE
from jaxtrain.model import ModelConfig, Transformer, generate


def sample(workdir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
           seed: int = 0, devices=None) -> str:
  """Text continuation of `prompt` (after the tokenizer's BOS) by the newest checkpoint of
  `workdir`, stopped after EOS; temperature 0 is greedy, top_k 0 samples from the whole
  vocabulary."""
  cfg, params, extra = pretrained.read_step(workdir)
  check_sampling(cfg.model, max_new_tokens, temperature, top_k)
  tokenizer = load_tokenizer(cfg, workdir)
  try:
    prompt_ids = np.concatenate([[tokenizer.bos], tokenizer.encode(prompt)]).astype(np.int32)
  except ValueError as e:  # a symbol outside the synthetic language
    raise config_lib.ConfigError(str(e)) from e
  out = continue_ids(cfg.model, params, extra, prompt_ids, max_new_tokens, temperature, top_k, seed,
                     devices)
  if tokenizer.eos in out:  # stop at the end of the document
    out = out[: list(out).index(tokenizer.eos) + 1]
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
