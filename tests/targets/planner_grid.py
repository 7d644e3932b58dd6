"""The planner against XLA:TPU: predicted per-device memory (`jaxtrain.plan.predict`) beside what
the TPU compiler assigns to the same train step (`jaxtrain.compile_for`), for the configs the TPU
scales of jaxtrain/plan/activations.py were fitted on (FIT) and the shipped configs they are checked
on (`check`: tests/targets/test_configs.CASES, where the same check is a test).

  JAX_PLATFORMS=cpu python -m tests.targets.planner_grid [fit|check]   (needs the tpu extra)

prints one JSON line per case: predicted parts, compiled parts, predicted / compiled."""

import json
import sys

import jaxtrain
from jaxtrain import config as config_lib
from jaxtrain.aot import compile_for, targets
from jaxtrain.plan import predict

# (name, config, target, overrides): small and mid-size dense models on 4-chip slices, each remat
# policy, data and fsdp meshes, two batch sizes
FIT = [
    ("gpt2_small b16 none data", "gpt2_small", "tpu-v5p:2x2x1", {"train.batch_size": 16}),
    ("gpt2_small b32 full data", "gpt2_small", "tpu-v5p:2x2x1",
     {"train.batch_size": 32, "model.remat": "full"}),
    ("gpt2_small b16 dots fsdp", "gpt2_small", "tpu-v5p:2x2x1",
     {"train.batch_size": 16, "model.remat": "dots", "mesh.data": 1, "mesh.fsdp": -1}),
    ("llama_1b b16 dots fsdp", "llama_1b", "tpu-v5p:2x2x1", {"train.batch_size": 16}),
    ("llama_1b b32 full fsdp", "llama_1b", "tpu-v5p:2x2x1",
     {"train.batch_size": 32, "model.remat": "full"}),
]
def config(name: str, overrides: dict):
  cfg = jaxtrain.get_config(f"configs/{name}.py")
  for key, value in overrides.items():
    section, field = key.split(".", 1)
    cfg[section][field] = value
  return cfg


def row(label: str, name: str, target: str, overrides: dict, report=None) -> dict:
  """Prediction and compilation of one case (`report`: an earlier compile_for of it)."""
  cfg = config(name, overrides)
  spec = targets.parse(target)
  config_lib.validate(cfg, spec.n_devices)
  plan = predict(cfg, spec.n_devices, spec.kind, suggest=False)
  report = report or compile_for(cfg, target, name)
  compiled = report.memory
  return {"case": label, "target": target, "predicted": plan.memory, "compiled": compiled,
          "ratio": plan.memory["total"] / compiled["total"] if compiled else None,
          "refusal": report.refusal}


if __name__ == "__main__":
  if sys.argv[1:] == ["fit"]:
    cases = FIT
  else:
    from tests.targets.test_configs import CASES
    cases = [(c[0], c[0], c[1], c[2]) for c in (getattr(c, "values", c) for c in CASES)]
  for case in cases:
    print(json.dumps(row(*case)), flush=True)
