"""Text continuation of a prompt by a trained model (moved out of loop.py; being reworked)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import checkpoint, config as config_lib, data, optim, parallel
from jaxtrain.model import generate
from jaxtrain.train.lm import LanguageModel
from jaxtrain.train.loop import restore_state
from jaxtrain.train.workdir import load_config


def sample(workdir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int = 0,
           devices=None) -> str:
  """Text continuation of `prompt` by the model trained in `workdir` (newest checkpoint)."""
  if max_new_tokens < 1 or temperature < 0 or top_k < 0:
    raise config_lib.ConfigError("sample: max_new_tokens must be >= 1, temperature and top_k >= 0")
  cfg = load_config(workdir)
  tokenizer = data.make_tokenizer(cfg, workdir)
  try:
    prompt_ids = np.concatenate([[tokenizer.bos], tokenizer.encode(prompt)]).astype(np.int32)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e
  if len(prompt_ids) + max_new_tokens > cfg.model.max_seq_len:
    raise config_lib.ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                                 f"exceeds model.max_seq_len={cfg.model.max_seq_len}")
  ckpts = checkpoint.Checkpoints(cfg, workdir, read_only=True)
  if ckpts.latest()[0] is None:
    raise config_lib.ConfigError(f"no checkpoint in {workdir}; train first")
  cfg.mesh.update({"replica": 1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1})
  mesh = parallel.make_mesh(cfg.mesh, devices or jax.local_devices()[:1])
  task = LanguageModel(cfg, workdir)
  tx = optim.build(cfg.optim, cfg.train.steps)[0]
  state = restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  model = task.model
  ckpts.close()
  gen = jax.jit(generate, static_argnums=(0, 4, 5, 6))
  tokens = gen(model, state.params, jnp.asarray(prompt_ids)[None], jax.random.key(seed), max_new_tokens,
               temperature, top_k, state.extra)
  out = np.asarray(tokens[0])
  if tokenizer.eos in out:  # stop at the end of the document
    out = out[: list(out).index(tokenizer.eos) + 1]
  return tokenizer.decode(out)
