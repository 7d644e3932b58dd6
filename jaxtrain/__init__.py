"""jaxtrain: a JAX research framework for training language models.

Library API (everything the CLI does):
  cfg = jaxtrain.get_config("configs/tiny.py")       # or configs.tiny.get_config(None)
  final = jaxtrain.train(cfg, "runs/tiny")            # -> last logged metrics
  text = jaxtrain.sample("runs/tiny", "< 5 6 7 |", max_new_tokens=8, temperature=0, top_k=0)
  cfg, params, apply = jaxtrain.load_pretrained("hf_or_run_dir")   # logits = apply(params, tokens)
"""

from jaxtrain.config import ConfigError, default_config, load_config_file as get_config, validate
from jaxtrain.train import sample, train
from jaxtrain.checkpoint.pretrained import load_pretrained  # noqa: E402 (after train: hf imports the model)
