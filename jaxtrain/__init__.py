"""jaxtrain: a JAX research framework for training language models.

Library API (everything the CLI does):
  cfg = jaxtrain.get_config("configs/tiny.py")       # or configs.tiny.get_config(None)
  # -> last logged metrics (train.task: lm, sft, rm, dpo, grpo, ppo)
  final = jaxtrain.train(cfg, "runs/tiny")
  text = jaxtrain.sample("runs/tiny", "< 5 6 7 |", max_new_tokens=8, temperature=0, top_k=0)
  cfg, params, apply = jaxtrain.load_pretrained("hf_or_run_dir")   # logits = apply(params, tokens)
  scores = jaxtrain.evaluate("runs/tiny", ["arc.jsonl", "wiki.jsonl"])  # {task: {metric: value}}
  # metrics.jsonl: a pandas DataFrame (list of dicts without pandas)
  table = jaxtrain.read_metrics("runs/tiny")
  fig = jaxtrain.plot("runs/tiny", keys=("loss", "eval_loss"))   # matplotlib, entropy floor dashed
  print(jaxtrain.compile_for(cfg, "tpu-v5p:4x4x4").table())  # memory, FLOPs, collectives; no TPU

Importing jaxtrain does not import jax: the names below that need it are loaded on first use, so
that JAX_PLATFORMS and XLA_FLAGS set after `import jaxtrain` still take effect.
"""

import importlib

from jaxtrain.config import ConfigError, ModelConfig, default_config, validate
from jaxtrain.config_files import load_config_file as get_config

_LAZY = {  # name -> (module, attribute or None for the module itself)
    "train": ("jaxtrain.train", None),  # callable: jaxtrain.train(cfg, workdir, ...)
    "sample": ("jaxtrain.train", "sample"),
    "load_config": ("jaxtrain.train", "load_config"),
    "TrainState": ("jaxtrain.train", "TrainState"),
    "Task": ("jaxtrain.train", "Task"),
    "LanguageModel": ("jaxtrain.train", "LanguageModel"),
    "posttrain": ("jaxtrain.posttrain", None),  # train.task sft, rm, dpo, grpo, ppo
    "load_reward_model": ("jaxtrain.posttrain.reward", "load_reward_model"),
    "load_pretrained": ("jaxtrain.checkpoint.pretrained", "load_pretrained"),
    "plot": ("jaxtrain.plotting", "plot"),
    "evaluate": ("jaxtrain.eval", "evaluate"),
    # compile for a TPU slice or GPUs this host lacks (the tpu / cuda extra)
    "compile_for": ("jaxtrain.aot.compile", "compile_for"),
}


def read_metrics(workdir: str, as_frame: bool | None = None):
  """DIR/metrics.jsonl as a table: a pandas DataFrame (a row per line, a column per key) when pandas
  is installed, else a list of dicts; `as_frame=False` always gives the list
  (jaxtrain.metrics.read_metrics)."""
  from jaxtrain import metrics
  return metrics.read_metrics(workdir, as_frame=as_frame)


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module 'jaxtrain' has no attribute {name!r}")
  module, attribute = _LAZY[name]
  value = importlib.import_module(module)
  return value if attribute is None else getattr(value, attribute)


__all__ = [
    "ConfigError", "ModelConfig", "default_config", "get_config", "read_metrics", "validate", *_LAZY
]
