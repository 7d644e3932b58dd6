"""Streaming DiLoCo's fragment syncs overlap the next inner step's compute in the compiled schedule (compiled,
not executed): a call of 4 steps (train.steps_per_call=4) with 2 fragments of H=4 landing a step late, traced at
its positions (builder.overlapped), compiled for 8 H100s deviceless, one replica each. The fragment sent at the
call's second step is an all-to-all and an all-gather (the f32 and int8 wires' two-collective reduction), each
an asynchronous start/done pair; the schedule puts kernels of the third step, matmuls of its backward pass among
them, between start and done. The control: the same config one step a call, where the sync runs inside the
step's conditional and no matmul runs beside it. With 4 replicas x 2 data, XLA:GPU's scheduler keeps one
collective in flight at a time, so the sync waits for the step's own gradient all-reduces over data and overlaps
only the step's last reductions; XLA:TPU keeps such collectives synchronous (benchmarks/RESULTS.md, "Overlapped
DiLoCo syncs"). Skipped without the CUDA plugin (make test-targets installs it)."""

import pytest

from jaxtrain import builder
from jaxtrain.aot.compile import scheduled_hlo
from jaxtrain.parallel import hlo_schedule
from tests.fixtures import tiny_config

TARGET = "h100:8"
REPLICAS = 8


def config(steps_per_call: int, fmt: str = "f32"):
  """configs/tiny.py's model on 8 replicas; XLA attention (the Pallas kernel's per-shard map does not
  nest in DiLoCo's manual replica axis on GPU)."""
  return tiny_config(
      mesh=dict(replica=REPLICAS, data=8 // REPLICAS),
      train=dict(steps=100, batch_size=16, steps_per_call=steps_per_call),
      model=dict(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, attention="xla"),
      diloco=dict(inner_steps=4, fragments=2, delay=1, format=fmt))


def sync_spans(text: str) -> list:
  return [s for s in hlo_schedule.spans(text)
          if "diloco_sync" in s.start.op_name or "comm_every" in s.start.op_name]


# int8 (66 s on 2 EPYC cores, 2026-12-07) places its sync as f32 does: `long`, out of CI
@pytest.mark.parametrize("fmt", ["f32", pytest.param("int8", marks=pytest.mark.long)])
def test_a_fragment_sync_spans_the_next_steps_compute(target_devices, fmt):
  target_devices(TARGET)
  cfg = config(4, fmt)
  assert builder.overlapped(cfg)
  spans = [s for s in sync_spans(scheduled_hlo(cfg, TARGET)) if "call_step_1/" in s.start.op_name]
  kinds = {s.kind for s in spans}
  assert {"all-to-all", "all-gather"} <= kinds, kinds
  for span in spans:
    later = [i for i in span.compute if "call_step_2/" in i.op_name]
    matmuls = [i for i in later if "gemm" in i.name or "dot" in i.name]
    print(span.kind, span.start.name, len(span.compute), "kernels between start and done,", len(later),
          "of the next step,", len(matmuls), "matmuls")
  # the data moves while the next step computes: each pair has the next step's kernels, matmuls among them,
  # between its start and its done
  assert all(any("call_step_2/" in i.op_name for i in s.compute) for s in spans)
  assert any("gemm" in i.name or "dot" in i.name for s in spans for i in s.compute if "call_step_2/" in i.op_name)


def test_one_step_a_call_runs_its_sync_alone(target_devices):
  target_devices(TARGET)
  cfg = config(1)
  assert not builder.overlapped(cfg)
  spans = sync_spans(scheduled_hlo(cfg, TARGET))
  assert spans  # the sync's pairs, inside the step's conditional
  assert not any("gemm" in i.name or "dot" in i.name for s in spans for i in s.compute), \
      [(s.computation, s.kind, [i.name for i in s.compute]) for s in spans]
