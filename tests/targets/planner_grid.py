"""The planner against XLA:TPU: predicted per-device memory (`jaxtrain.plan.predict`) beside what
the TPU compiler assigns to the same train step (`jaxtrain.compile_for`), for the configs the TPU
scales of jaxtrain/plan/activations.py were fitted on (FIT) and the shipped configs they are checked
on (`check`: tests/targets/test_configs.CASES, where the same check is a test).

  JAX_PLATFORMS=cpu python -m tests.targets.planner_grid [fit|moe|check]   (needs the tpu extra)

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
# MoE: mixtral_8x7b's layout at 1/4 width and 4 layers (E 8, top-2), and a fine-grained one (E 32,
# top-8, a shared expert, the first layer dense), on 4- and 8-chip slices with expert 2-8: what the
# dispatch holds (activations.expert_rows, Scales.dispatch). Checked on mixtral_8x7b itself.
SMALL_MOE = {"model.n_layers": 4, "model.d_model": 1024, "model.n_heads": 8, "model.n_kv_heads": 2,
             "model.d_ff": 3584, "train.batch_size": 16, "train.seq_len": 2048}
FINE_MOE = {**SMALL_MOE, "model.n_experts": 32, "model.top_k": 8, "model.d_ff_expert": 512,
            "model.n_shared_experts": 1, "model.router": "sigmoid", "model.moe_first_dense": 1}
MOE_FIT = [
    ("moe e8 full expert4", "mixtral_8x7b", "tpu-v5p:2x2x1", {**SMALL_MOE, "mesh.expert": 4}),
    ("moe e8 none expert2 fsdp2", "mixtral_8x7b", "tpu-v5p:2x2x1",
     {**SMALL_MOE, "mesh.expert": 2, "model.remat": "none", "train.batch_size": 8}),
    ("moe e32 full expert8", "mixtral_8x7b", "tpu-v5p:2x2x2", {**FINE_MOE, "mesh.expert": 8}),
    ("moe e32 capacity expert4 fsdp2", "mixtral_8x7b", "tpu-v5p:2x2x2",
     {**FINE_MOE, "mesh.expert": 4, "model.dispatch": "capacity"}),
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
  elif sys.argv[1:] == ["moe"]:
    cases = MOE_FIT
  else:
    from tests.targets.test_configs import CASES
    cases = [(c[0], c[0], c[1], c[2]) for c in (getattr(c, "values", c) for c in CASES)]
  for case in cases:
    print(json.dumps(row(*case)), flush=True)
