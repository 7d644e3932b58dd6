"""The `eval` section: task files (jaxtrain/eval/tasks.py) scored inside the training loop every
eval.every_steps (jaxtrain/eval/loop.py), defaults and checks. No jax import here."""

import os

import ml_collections

from jaxtrain.config.errors import ConfigError


def eval_defaults() -> ml_collections.ConfigDict:
  e = ml_collections.ConfigDict()
  e.tasks = ""  # comma-separated JSONL task files; "" = no in-loop task evaluation
  e.every_steps = 0  # 0 = train.eval_every's steps (and the last step, as eval loss)
  e.limit = 0  # the first N docs of each task; 0 = all
  e.num_fewshot = -1  # solved examples before each doc; -1 = each task's own (a YAML's, else 0)
  e.seed = 0  # the few-shot draw's seed
  return e


def task_paths(cfg) -> list[str]:
  """eval.tasks as a list of paths."""
  return [p.strip() for p in cfg.eval.tasks.split(",") if p.strip()]


def every_steps(cfg) -> int:
  """How often the in-loop tasks run (0: never)."""
  if not task_paths(cfg):
    return 0
  return cfg.eval.every_steps or cfg.train.eval_every


def validate_eval(cfg) -> None:
  e = cfg.eval
  for key in ("every_steps", "limit", "num_fewshot", "seed"):
    if isinstance(e[key], (str, float)) or e[key] < (-1 if key == "num_fewshot" else 0):
      own = " (or -1: each task's own)" if key == "num_fewshot" else ""
      raise ConfigError(f"eval.{key} must be an integer >= 0{own}, got {e[key]!r}")
  paths = task_paths(cfg)
  if not paths:
    return
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise ConfigError(f"eval.tasks: no such task file: {', '.join(missing)}")
  if not every_steps(cfg):
    raise ConfigError("eval.tasks is set but eval.every_steps and train.eval_every are 0: set "
                      "eval.every_steps")
  if cfg.train.task != "lm":
    raise ConfigError(f"eval.tasks scores a language model's params: train.task={cfg.train.task!r} "
                      "is not supported (evaluate its checkpoints with python -m jaxtrain eval)")
