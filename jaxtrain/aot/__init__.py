"""Ahead-of-time compilation for accelerators this host does not have: `compile_for(cfg,
"tpu-v5p:4x4x4")` compiles the train step with the target's own compiler (targets.py says which
targets and what they need installed)."""

import importlib


def __getattr__(name: str):
  if name in ("compile_for", "Compiled", "matmul_flops"):
    return getattr(importlib.import_module("jaxtrain.aot.compile"), name)
  raise AttributeError(f"module 'jaxtrain.aot' has no attribute {name!r}")
