"""evaluate: a model (a training workdir, a Hugging Face directory, or params + config + tokenizer)
scored on task files, a dict of metrics per task."""

import os

from jaxtrain import config as config_lib
from jaxtrain.checkpoint import convert, hf, pretrained
from jaxtrain.data import tokenizers
from jaxtrain.eval import score, tasks as tasks_lib
from jaxtrain.model import ModelConfig
from jaxtrain.train import sampling


def load_model(path: str):
  """(ModelConfig, params, extra, tokenizer) of a workdir's or tier's newest step, or of a HF Llama
  or Mixtral directory (its tokenizer.json or tokenizer.model)."""
  if hf.is_hf_dir(path):
    cfg, params = hf.import_hf(path)
    tokenizer_file = convert.hf_tokenizer(path)
    if tokenizer_file is None:
      raise config_lib.ConfigError(f"{path} has no tokenizer.json or tokenizer.model")
    try:
      return cfg, params, {}, tokenizers.from_file(tokenizer_file)
    except ValueError as e:  # no BOS/EOS tokens
      raise config_lib.ConfigError(str(e)) from None
  cfg, params, extra = pretrained.read_step(path)
  if cfg.train.task == "vlm":
    raise config_lib.ConfigError(f"{path}: evaluate scores text alone; a vlm run answers about "
                                 "images (its eval_accuracy is in metrics.jsonl)")
  return ModelConfig.from_config(cfg.model), params, extra, sampling.load_tokenizer(cfg, path)


def model_config(config) -> ModelConfig:
  """A ModelConfig from itself, a whole config (its model section) or a model section."""
  if isinstance(config, ModelConfig):
    return config
  return ModelConfig.from_config(config["model"] if "model" in config else config)


def evaluate(params_or_workdir, tasks, *, config=None, tokenizer=None, extra=None,
             num_fewshot: int | None = None, seed: int = 0, limit: int | None = None, rows: int = 8,
             seq_len: int | None = None, mesh=None, mesh_rules: str = "fsdp") -> dict:
  """{task name: {metric: value}} for task files (paths or tasks.Task) scored by the model of a
  workdir / HF directory, or by `params` with `config` (a ModelConfig or config) and `tokenizer`.
  num_fewshot None: each task's own (a task YAML's num_fewshot, else 0)."""
  if isinstance(params_or_workdir, (str, os.PathLike)):
    model_cfg, params, extra, tokenizer = load_model(os.fspath(params_or_workdir))
  else:
    if config is None or tokenizer is None:
      raise config_lib.ConfigError("evaluate(params, ...) needs config= and tokenizer=")
    model_cfg, params = model_config(config), params_or_workdir
  if model_cfg.arch == "encoder":
    raise config_lib.ConfigError("evaluate scores a decoder's log-likelihoods; this model is a "
                                 "masked-LM encoder (model.arch=encoder)")
  if (num_fewshot is not None and num_fewshot < 0) or (limit is not None and limit < 1):
    raise config_lib.ConfigError(
        f"evaluate: num_fewshot={num_fewshot} must be >= 0 and limit={limit} >= 1")
  loaded = tasks_lib.load_tasks([tasks] if isinstance(tasks, (str, os.PathLike)) else tasks,
                                "evaluate")
  scorer = score.Scorer(model_cfg, params, extra, rows, seq_len, mesh, mesh_rules)
  return {t.name: tasks_lib.run(t, scorer, tokenizer, num_fewshot, seed, limit) for t in loaded}
