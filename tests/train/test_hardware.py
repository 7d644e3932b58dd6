"""Hardware health: each part of the risk from injected readings (NVML's ECC counts, throttling and
temperature; a tier's disk; host memory), the adaptive policy's interval capped by the risk, a run
whose injected ECC errors shorten its interval with a `checkpoint_policy` row, and the real readers
on this host (no NVML here: that part absent, nothing printed)."""

import os
import warnings

import jax
import pytest

import jaxtrain
from jaxtrain import config as config_lib, metrics
from jaxtrain.config import ConfigError
from jaxtrain.checkpoint import policy
from jaxtrain.train import hardware
from jaxtrain.train.hardware import Gpu, Health
from tests.fixtures import tiny_config

GIB = 2**30


def gpus(*readings):
  """A GPU reader returning each reading in turn (lists of Gpu)."""
  it = iter(readings)
  return lambda: next(it)


def test_ecc_counts_new_errors_since_the_previous_reading():
  h = Health(gpus([Gpu(3, 100)], [Gpu(3, 105)], [Gpu(5, 105)], [Gpu(5, 500)]))
  assert h.read()["risk_ecc"] == 0.0  # errors before the run began are not new
  assert h.read()["risk_ecc"] == 0.5  # 5 new corrected of ECC_CORRECTED=10
  r = h.read()
  assert (r["risk_ecc"], r["why_ecc"]) == (1.0, "2 new uncorrected ECC errors")
  assert h.read()["risk_ecc"] == 1.0  # 395 new corrected
  off = Health(gpus([Gpu()]))  # ECC disabled, no clock or temperature query: absent, not 0
  assert off.read() == {"risk_ecc": None, "why_ecc": "ECC off", "risk_thermal": None,
                        "why_thermal": "not supported", "risk_disk": None, "why_disk": "not read",
                        "risk_memory": None, "why_memory": "no /proc/meminfo"}


def test_throttling_and_temperature():
  h = Health(gpus([Gpu(0, 0, 0x1, 85.0), Gpu(0, 0, 0, 70.0)], [Gpu(0, 0, 0x40, 60.0)],
                  [Gpu(throttle=0x4, temperature=95.0)]))
  r = h.read()  # GPU idle (0x1) is no trouble; 85 C is halfway from TEMP_OK=80 to TEMP_HOT=90
  assert (r["risk_thermal"], r["why_thermal"]) == (0.5, "GPU 0 at 85 C")
  r = h.read()
  assert (r["risk_thermal"], r["why_thermal"]) == (1.0, "GPU 0: thermal slowdown (hardware)")
  assert h.read()["risk_thermal"] == 1.0  # too hot; an applications-clock cap (0x4) alone is not


def test_disk_of_each_tier_and_host_memory():
  disks = iter([{"persistent": (50 * GIB, 100 * GIB), "fast": (3 * GIB, 100 * GIB)},
                {"persistent": (int(7.5 * GIB), 100 * GIB)}, {"persistent": (20 * GIB, 100 * GIB)}])
  memory = iter([(40, 100), (6, 100), (2, 100)])
  h = Health(None, lambda: next(disks), lambda: next(memory))
  r = h.read()
  assert (r["risk_disk"], r["why_disk"]) == (1.0, "fast tier: 3.0 GiB free (3.0%)")
  assert r["risk_memory"] == 0.0 and r["risk_ecc"] is None and r["risk_thermal"] is None
  r = h.read()
  assert r["risk_disk"] == pytest.approx(0.5) and r["risk_memory"] == pytest.approx(0.8)
  r = h.read()
  assert (r["risk_disk"], r["risk_memory"], r["why_memory"]) == (0.0, 1.0, "host memory 2.0% available")


def test_the_run_risk_is_the_worst_part_of_any_process():
  calm = Health(None, lambda: {"persistent": (50, 100)}, lambda: (50, 100)).read()
  full = Health(None, lambda: {"persistent": (4, 100)}, lambda: (50, 100)).read()
  row = hardware.combine([calm, full])
  assert row["risk"] == row["risk_disk"] == 1.0 and row["risk_ecc"] is None
  assert row["why"] == "disk 1.00 (process 1: persistent tier: 0.0 GiB free (4.0%))"
  assert hardware.combine([calm]) == {"risk": 0.0, "risk_ecc": None, "risk_thermal": None,
                                      "risk_disk": 0.0, "risk_memory": 0.0, "why": "nothing"}
  broken = Health(None, lambda: 1 / 0, None).read()  # a reader that fails is absent, not an error
  assert (broken["risk_disk"], broken["why_disk"]) == (None, "unreadable: ZeroDivisionError")


def test_the_risk_caps_the_adaptive_interval():
  p = policy.AdaptivePolicy(min_steps=10, max_steps=200)
  for step in (10, 30, 70, 150):
    p.saved(step)
  assert p.interval == 160
  assert p.hardware(160, 0.0, "nothing") is None and p.interval == 160  # low risk: unchanged
  assert p.hardware(170, 0.1, "x") is None and p.interval == 160  # cap 180 > 160
  assert p.hardware(180, 0.5, "disk 0.50 (...)") == \
      "interval -> 100 steps (hardware risk 0.50 at step 180: disk 0.50 (...))"
  p.saved(280)
  assert p.interval == 100  # calm saves double it up to the cap only
  assert p.hardware(290, 1.0, "ecc 1.00") == "interval -> 10 steps (hardware risk 1.00 at step 290: ecc 1.00)"
  p.hardware(300, 0.0, "nothing")
  p.saved(310)
  assert p.interval == 20  # risk gone: doubling again


def test_injected_ecc_errors_shorten_the_interval_of_a_run(tmp_path):
  # adaptive 2..16: the save at step 2 doubles the interval (4, or 8 after a save at 6 when step 2's is
  # done by then); readings at steps 4 (calm), 8 (two new uncorrected ECC errors: risk 1, cap 2), 12 (calm)
  readings = gpus([Gpu(0, 0, 0, 40.0)], [Gpu(0, 0, 0, 40.0)], [Gpu(2, 0, 0, 40.0)], [Gpu(2, 0, 0, 40.0)])
  cfg = tiny_config(train=dict(steps=12),
                    checkpoint=dict(adaptive=True, adaptive_min_steps=2, adaptive_max_steps=16,
                                    health_every_steps=4))
  health = Health(readings, hardware.disk_reader({"persistent": str(tmp_path)}), lambda: (50, 100))
  health.read()  # the reading before the run: ECC counts 0
  jaxtrain.train(cfg, str(tmp_path), devices=jax.devices()[:1], progress=False, sync_every_step=True,
                 hardware=health)
  rows = metrics.read_metrics(str(tmp_path))
  health_rows = [r for r in rows if r.get("event") == "hardware_health"]
  assert [(r["step"], r["risk"], r["risk_ecc"]) for r in health_rows] == [(4, 0.0, 0.0), (8, 1.0, 1.0),
                                                                        (12, 0.0, 0.0)]
  assert health_rows[1]["why"] == "ecc 1.00 (2 new uncorrected ECC errors)"
  decisions = [(r["step"], r["decision"]) for r in rows if r.get("event") == "checkpoint_policy"]
  hardware_decisions = [d for d in decisions if "hardware" in d[1]]
  assert hardware_decisions == [(8, "persistent: interval -> 2 steps (hardware risk 1.00 at step 8: ecc 1.00 "
                                    "(2 new uncorrected ECC errors))")], decisions


def test_the_real_readers_run_here_without_a_word(tmp_path, capfd):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    h = Health.of_host({"persistent": str(tmp_path / "not_yet" / "checkpoints"), "remote": "gs://b/r"},
                       [0], on_gpu=False)
    r = h.read()
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: NVML absent, not an error
      assert hardware.nvml_reader([0]) is None
  assert r["risk_ecc"] is None and r["risk_thermal"] is None
  assert 0.0 <= r["risk_disk"] <= 1.0 and r["why_disk"].startswith("persistent tier: ")
  assert 0.0 <= r["risk_memory"] <= 1.0 and r["why_memory"].startswith("host memory ")
  assert capfd.readouterr() == ("", "")


def test_a_negative_reading_interval_is_one_line():
  with pytest.raises(ConfigError, match=r"^checkpoint.health_every_steps must be >= 0, got -1$"):
    config_lib.validate(tiny_config(checkpoint=dict(health_every_steps=-1)), 8)
