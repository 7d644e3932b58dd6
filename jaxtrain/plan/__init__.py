"""The planner: per-device memory and step time of a config before any run (`predict`), the compiled
reference it is checked against (`compiled.compiled_memory`), and train.batch_size=auto
(`auto.resolve`).

Importing the package imports no jax (the CLI reads `devices.KINDS` before jax loads); `predict`,
`Plan` and `MEMORY_KEYS` load on first use."""

import importlib


def __getattr__(name: str):
  if name in ("predict", "Plan", "MEMORY_KEYS"):
    return getattr(importlib.import_module("jaxtrain.plan.estimate"), name)
  raise AttributeError(f"module 'jaxtrain.plan' has no attribute {name!r}")
