"""Bytes over the replica axis per optimizer step, read from the compiled train step (4 replicas x 2
data): each wire format's saving against float32 data parallelism, DiLoCo's inner steps silent on the
replica axis, its syncs H times rarer, and streaming's syncs P times smaller."""

import pytest

pytestmark = pytest.mark.slow  # a dozen compilations of the train step: CI's slow set

from jaxtrain.parallel import hlo_bytes
from jaxtrain.train import comm
from tests.fixtures import tiny_config


def config(**sections):
  """configs/tiny.py's model (426,624 parameters: big enough that 256-element blocks pad little)."""
  base = dict(mesh=dict(replica=4, data=2), train=dict(batch_size=16),
              model=dict(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                         max_seq_len=256, scan_layers=False))
  return tiny_config(**{**base, **sections})


def replica_rows(cfg):
  return [r for r in hlo_bytes.collectives(*comm.step_hlo(cfg)) if "replica" in r.axes]


@pytest.fixture(scope="module")
def dp_bytes():
  return comm.measure([comm.baseline(config())])[0]["reduced"]


def test_each_format_sends_its_share_of_float32(dp_bytes):
  formats = ["bf16", "fp8", "int8", "int4"]
  measured = comm.measure([config(comm=dict(format=f)) for f in formats])
  ratio = {f: dp_bytes / m["reduced"] for f, m in zip(formats, measured)}
  # bf16 and fp8 carry no scales (fp8's one agreed scale is a 4-byte pmax); the loss's few sums are float32
  assert ratio["bf16"] == pytest.approx(2.0, rel=1e-3)
  assert ratio["fp8"] == pytest.approx(4.0, rel=1e-3)
  assert 3.8 <= ratio["int8"] < 4.0 and 7.5 <= ratio["int4"] < 8.0, ratio
  # the payloads cross as u16/u8, never widened: exactly the padded vector's bytes in the format, sent by an
  # all-to-all and an all-gather, (G-1)/G each (int8/int4 add one float32 scale per 256 elements)
  n, shards = measured[0]["params"], 4
  padded = -(-n // (shards * 256)) * shards * 256
  for f, m in zip(formats, measured):
    wire = {"bf16": "u16", "fp8": "u8", "int8": "u8", "int4": "u8"}[f]
    bits = {"bf16": 16, "fp8": 8, "int8": 8, "int4": 4}[f]
    pad = padded if f in ("int8", "int4") else -(-n // (2 * shards)) * 2 * shards
    assert m["by_axis"][("replica", wire)] == 2 * (shards - 1) / shards * pad * bits / 8, f


def test_error_feedback_sends_no_more_than_its_format(dp_bytes):
  plain, ef, ef21 = comm.measure([config(comm=dict(format="int4", error_feedback=e))
                                  for e in ("none", "ef", "ef21")])
  assert ef["reduced"] == plain["reduced"] == ef21["reduced"]


def test_diloco_inner_steps_send_nothing_over_replica_and_syncs_cost_dp_over_h(dp_bytes):
  rows = replica_rows(config(diloco=dict(inner_steps=10)))
  assert rows and all(r.every == 10 for r in rows), [(r.kind, r.every, r.op_name) for r in rows]
  per_step = sum(r.per_step for r in rows)
  assert per_step == pytest.approx(dp_bytes / 10, rel=0.01)


def test_streaming_sync_peak_is_the_full_sync_over_p():
  def sync_bytes(**diloco):
    rows = replica_rows(config(diloco=diloco))
    assert all(r.every > 1 for r in rows)
    return sum(r.bytes_sent * r.runs for r in rows), sum(r.per_step for r in rows)
  full, full_per_step = sync_bytes(inner_steps=8)
  peak, per_step = sync_bytes(inner_steps=8, fragments=2, delay=1)
  assert peak == pytest.approx(full / 2, rel=0.05)
  assert per_step == pytest.approx(full_per_step, rel=0.01)  # the same bytes in all, spread over the interval
  # what `python -m jaxtrain comm` reports: the largest single sync and its period, P-fold smaller and P-fold
  # more frequent with P fragments
  whole, streamed = comm.measure([config(diloco=dict(inner_steps=8)),
                                  config(diloco=dict(inner_steps=8, fragments=2, delay=1))])
  assert (whole["sync"], whole["sync_every"], streamed["sync_every"]) == (full, 8, 4)
  assert streamed["sync"] == peak
  # the step that syncs also sends what every step sends (the gradient's all-reduce over data), the same
  # with and without fragments
  every_step = whole["peak_step"] - whole["sync"]
  assert every_step > 0 and streamed["peak_step"] - streamed["sync"] == pytest.approx(every_step)
  report = comm.format_report(comm._report(config(), streamed, comm.measure([comm.baseline(config())])[0]))
  assert f"largest single sync: {peak:,.0f} bytes per device, once every 4 steps" in report
