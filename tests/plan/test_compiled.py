"""The planner against XLA: per-device memory within 15% of the compiled step's memory_analysis() (argument +
output + temp - alias) for (config, mesh, remat) combinations on 8 virtual CPU devices; step time within 30%
of the fastest measured step; train.batch_size=auto picks a batch that compiles within the limit while one batch
step more is predicted not to fit, and records the choice."""

import json
import os

import pytest

import jaxtrain
from jaxtrain import config as config_lib
from jaxtrain.plan import auto, estimate
from jaxtrain.plan.compiled import compiled_memory
from tests.fixtures import tiny_config
from tests.plan.accuracy import predicted_and_measured

# memory and step time as XLA optimizes them (tests/conftest.py turns optimizing off for the rest)
pytestmark = pytest.mark.optimized

MEMORY_TOLERANCE = 0.15
STEP_TIME_TOLERANCE = 0.30


def small(**sections):
  """A 2-layer model whose step compiles in seconds, with activations that matter next to its state."""
  cfg = tiny_config()
  cfg.model.update(d_model=64, head_dim=16, d_ff=256, vocab_size=256, max_seq_len=64, attention="xla")
  cfg.train.update(batch_size=32, seq_len=32)
  for name, values in sections.items():
    cfg[name].update(values)
  return cfg


def check_memory(cfg):
  compiled = compiled_memory(cfg, quick=True)
  memory = cpu_memory(cfg)
  # The state is exact, not estimated: the donated state aliases its outputs.
  assert memory["params"] + memory["opt_state"] == compiled["alias"]
  ratio = memory["total"] / compiled["total"]
  assert abs(ratio - 1) <= MEMORY_TOLERANCE, (ratio, memory, compiled)


def cpu_memory(cfg) -> dict:
  """predict(cfg, 8, "cpu").memory without its step-time half (the CPU matmul probe)."""
  return estimate.memory_bytes(cfg, config_lib.validate(cfg, 8), "cpu")[0]


@pytest.mark.slow  # each compile takes 5-15 s on the 2-core host
@pytest.mark.parametrize("sections", [
    {},  # data parallel, scanned layers, no remat
    {"mesh": {"data": 4, "tensor": 2, "rules": "fsdp_tp"}, "model": {"remat": "full"}},
    {"mesh": {"data": 1, "fsdp": 8}},
    {"mesh": {"data": 4, "fsdp": 2}, "model": {"remat": "dots"}},
    {"model": {"remat": "full"}, "train": {"seq_len": 64}},
    {"model": {"scan_layers": False}, "train": {"batch_size": 64}},
    {"optim": {"name": "muon"}, "train": {"microbatches": 2}},
], ids=["dp-none", "fsdp_tp-full", "fsdp-none", "dp_fsdp-dots", "dp-full-seq64", "unrolled-bs64", "muon-microbatches"])
def test_memory_matches_the_compiled_step(sections):
  check_memory(small(**sections))


@pytest.mark.slow
def test_auto_batch_fits_the_limit_and_is_recorded(tmp_path):
  limit_gib = 12 / 1024  # 12 MiB a device: about 80 sequences of this model
  cfg = auto.with_train(small(train={"steps": 2, "device_memory_gib": limit_gib}), batch_size=config_lib.AUTO)
  jaxtrain.train(cfg, str(tmp_path), progress=False)
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  row = next(r for r in rows if r.get("event") == "auto_batch")
  batch, limit = row["batch_size"], limit_gib * 2**30
  assert json.load(open(os.path.join(tmp_path, "config.json")))["train"]["batch_size"] == batch
  assert row["compiled_bytes"] <= limit and batch >= 16
  # one batch step more is predicted not to fit (with the planner's margin for its own error)
  assert cpu_memory(auto.with_train(cfg, batch_size=batch + 8))["total"] > (1 - auto.MARGIN) * limit


@pytest.mark.slow
@pytest.mark.parametrize("spec, overrides, n_devices", [
    ("configs/tiny.py", {}, 8),
    ("configs/small_20m.py", {"train.batch_size": "2"}, 1),  # its model and length; a batch that runs in seconds
])
def test_step_time_within_30_percent(spec, overrides, n_devices):
  plan, measured = predicted_and_measured(spec, overrides, n_devices)
  assert abs(plan.step_time_s / measured - 1) <= STEP_TIME_TOLERANCE, (plan.step_time_s, measured)
