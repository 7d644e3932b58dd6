"""The `sample` section: what `python -m jaxtrain sample` generates, defaults and checks. No jax
import here."""

import math

import ml_collections

from jaxtrain.config.errors import check_floats

RANGES = {"sample.temperature": (0.0, math.inf, True)}


def sample_defaults() -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.prompt = ""
  s.max_new_tokens = 64
  s.temperature = 0.8
  s.top_k = 20
  return s


def validate_sample(cfg) -> None:
  check_floats("sample", cfg.sample, RANGES)
