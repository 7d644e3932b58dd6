"""Host offload (train.offload) compiled by XLA:TPU, deviceless (compiled, not executed): per-device
memory from `memory_analysis()` with and without each mode, and the bytes copied between the chip
and the host per step, counted in the compiled HLO (`parallel.hlo_host.host_transfers`).

The case: llama_1b's layers at 4 deep, data-parallel on a v5e 2x2 (16 GiB a chip; the state
replicated, so the optimizer's moments are 3.77 of the 13.5 GiB a chip), one row of 2048 tokens a
chip, remat full. Skipped without libtpu; each compile takes 1-2 minutes on two cores.
Activation offload is held where it decides whether a step fits: llama_70b with twice its batch
(tests/targets/test_configs.py). Figures: benchmarks/RESULTS.md, "Host offload"."""

import pytest

from jaxtrain.aot import compile_for
from tests.targets import planner_grid

TARGET = "tpu-v5e:2x2"
CASE = {"model.n_layers": 4, "model.remat": "full", "train.batch_size": 4, "mesh.data": -1,
        "mesh.fsdp": 1}
_compiled = {}


def compiled(mode: str):
  """(memory_analysis() per device, host bytes: "argument", "temp", "to_host", "to_device") of the
  case under `mode`, each mode compiled once."""
  if mode not in _compiled:
    cfg = planner_grid.config("llama_1b", {**CASE, "train.offload": mode})
    _compiled[mode] = compile_for(cfg, TARGET, "llama_1b")
    print(_compiled[mode].table())
  return _compiled[mode].memory, _compiled[mode].host


# the optimizer case compiles for 260 s on 2 EPYC cores (2026-12-07): `long`, out of CI, like the
# biggest configs (`make test-targets TARGETS_MARK=`); params offload crosses the same way
@pytest.mark.parametrize("mode, gib", [pytest.param("optimizer", 3.77, marks=pytest.mark.long),
                                       ("params", 1.88)])
def test_offloaded_state_leaves_the_arguments_and_crosses_twice(target_devices, mode, gib):
  """The offloaded field's shards (the moments: 2 x 4 B x 0.506 G params = 3.77 GiB; the params
  1.88 GiB) are host arguments, exactly what left the device's arguments, and each step copies them
  in and back out once. XLA:TPU starts the copy-in at the top of the step (its scheduler prefetches
  while the chip has room), so the copy is a temporary as large as the field: the step's device
  total moves little (measured -2.4% optimizer, -1.1% params), asserted not to grow."""
  target_devices(TARGET)
  none, _ = compiled("none")
  memory, host = compiled(mode)
  assert host["argument"] > 0.99 * gib * 2**30, host
  assert abs((none["argument"] - memory["argument"]) - host["argument"]) < 2**20, (none, memory)
  assert host["to_device"] == host["to_host"] == pytest.approx(host["argument"], rel=1e-3), host
  assert memory["total"] <= none["total"], (none, memory)


def test_no_offload_moves_nothing(target_devices):
  target_devices(TARGET)
  _, host = compiled("none")
  assert host == {"argument": 0, "temp": 0, "to_host": 0.0, "to_device": 0.0}


def test_params_offload_is_refused_on_gpu_in_one_line(target_devices):
  """XLA:GPU compiled gpt2_small's params in pinned host memory with none on the host (host
  argument 0 bytes, the params still device arguments; h100:8, 2026-12-03): refused before
  compiling."""
  from jaxtrain.config import ConfigError
  target_devices("h100:8")
  cfg = planner_grid.config("gpt2_small", {"train.offload": "params", "train.batch_size": 8})
  with pytest.raises(ConfigError, match="train.offload=params: XLA:GPU keeps the params") as e:
    compile_for(cfg, "h100:8", "gpt2_small")
  assert "\n" not in str(e.value)
