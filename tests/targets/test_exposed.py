"""`python -m jaxtrain comm --target`: the bytes whose collective overlaps compute in a target's
compiled schedule and the bytes exposed, and a projection that hides only what the schedule
overlaps. Compiled for 8 H100s deviceless (not executed); skipped without the CUDA plugin."""

import pytest

from jaxtrain.__main__ import main
from jaxtrain.aot.compile import scheduled
from jaxtrain.parallel import hlo_bytes, hlo_schedule
from jaxtrain.train import comm
from tests.fixtures import tiny_config
from tests.targets.test_overlap import TARGET, config as diloco_config

GBIT = 1.0


def exposed(measured: dict) -> float:
  return measured["reduced"] - measured["overlapped"]


def test_exposed_bytes_fall_when_a_sync_overlaps_the_next_steps(target_devices):
  target_devices(TARGET)
  one, four = comm.measure([diloco_config(1), diloco_config(4)], target=TARGET)
  # the same syncs, the same bytes per step: only their place in the schedule differs
  assert four["reduced"] == pytest.approx(one["reduced"], rel=1e-6)
  assert one["reduced"] > 0 and one["overlapped"] == 0.0
  assert 0 < four["overlapped"] <= four["reduced"]
  assert exposed(four) < exposed(one)
  # the modelled seconds a 1 Gbit/s link adds per step fall too, and never exceed the transfer
  step_s = 1e-3
  seconds = [comm.exposed_s(m["parts"], 1.0, GBIT, step_s) for m in (one, four)]
  assert seconds[1] < seconds[0] == pytest.approx(one["reduced"] * 8 / (GBIT * 1e9), rel=1e-9)


def fsdp_config():
  return fsdp_config_on(8)


def fsdp_config_on(devices: int):
  return tiny_config(mesh=dict(data=1, fsdp=devices, rules="fsdp"),
                     model=dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                head_dim=32, d_ff=384, max_seq_len=128, attention="xla"),
                     train=dict(batch_size=16, seq_len=128))


def test_async_collective_flags_let_fsdp_gathers_overlap(target_devices):
  target_devices(TARGET)
  shares = {}
  for flags in (False, True):
    text, mesh, _, _ = scheduled(fsdp_config(), TARGET, async_flags=flags)
    win = hlo_schedule.windows(text)
    rows = [r for r in hlo_bytes.collectives(text, mesh)
            if "fsdp" in r.axes and r.kind in ("all-gather", "reduce-scatter")]
    assert rows
    shares[flags] = sum(win.of(r.name) for r in rows) / win.flops
  print("share of matmul FLOPs beside FSDP's gathers and reductions:", shares)
  assert shares[True] > shares[False]
  assert shares[True] > 0.25


@pytest.mark.long  # 116 s on 2 EPYC cores (2026-12-07); comm.measure's bytes are checked above
def test_comm_cli_splits_bytes_by_what_the_target_schedule_hides(target_devices, capsys):
  target_devices(TARGET)
  assert main(["comm", "--config=configs/tiny.py", f"--target={TARGET}", "--project",
               "--config.mesh.replica=8", "--config.mesh.data=1", "--config.model.attention=xla",
               "--config.diloco.inner_steps=4", "--config.diloco.fragments=2",
               "--config.diloco.delay=1", "--config.train.steps_per_call=4"]) == 0
  out = capsys.readouterr().out
  line = next(x for x in out.splitlines() if f"in {TARGET}'s compiled schedule" in x)
  config_part = line.split(": ", 1)[1].split(";")[0]
  hidden, rest = config_part.removeprefix("config ").split(" overlap compute, ")
  assert float(hidden.replace(",", "")) > 0  # the streaming syncs overlap the next steps
  assert "exposed" in rest
  assert f"the compute {TARGET}'s compiled schedule runs beside each transfer" in out
  assert "config, by mesh axes: replica" in out


def test_tpu_and_gpu_schedules_count_the_same_matmul_flops(target_devices):
  # XLA:TPU writes batched matmuls as convolutions over padded, dilated windows, XLA:GPU as cuBLAS
  # calls and Triton fusions; the same step on 4 devices of each must count the same FLOPs, or the
  # compute a transfer hides behind (and comm's modelled step time) is wrong on one of them
  flops = {}
  for target in ("tpu-v5e:2x2", "h100:4"):
    target_devices(target)
    text = scheduled(fsdp_config_on(4), target)[0]
    flops[target] = hlo_schedule.windows(text).flops
  print("matmul FLOPs per device per step:", flops)
  assert flops["tpu-v5e:2x2"] == pytest.approx(flops["h100:4"], rel=0.02)
