"""train/goodput.py: the buckets' arithmetic (fake clock), the trapezoid energy integral (fake power sampler), and
real runs: the buckets add up to the wall time, eval and checkpoint time land in their buckets, and a resume after
a lost checkpoint counts its restore and the steps it recomputes."""

import os
import shutil
import time

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain.train import goodput as goodput_lib
from tests.fixtures import tiny_config

BUCKETS = [f"badput_{name}_s" for name in goodput_lib.BUCKETS]


class FakeClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def test_buckets_rewind_and_resume_with_a_fake_clock():
  clock = FakeClock()
  g = goodput_lib.Goodput(clock)
  for seconds, bucket, step in [(2, "init", None), (5, "compile", None), (1, "step", 1), (1, "step", 2),
                                (3, "eval", None), (1, "step", 3), (4, "checkpoint", None), (2, "step", 4)]:
    clock.t += seconds
    g.charge(bucket, step)
  row = g.row(4, tokens_per_step=100, price=3.0, units=2)
  assert row["goodput_productive_s"] == 5 and row["goodput_wall_s"] == 19 and row["goodput"] == 5 / 19
  buckets = (row["badput_init_s"], row["badput_compile_s"], row["badput_eval_s"], row["badput_checkpoint_s"])
  assert buckets == (2, 5, 3, 4)
  assert row["cost_per_mtok"] == pytest.approx(3.0 * 2 * 19 / 3600 / (400 / 1e6))
  assert "energy_j" not in row
  assert goodput_lib.summary(row) == (
      "goodput 26.3%: 5.00 s of productive steps in 19.00 s since the job began (0 restarts); badput: init 2.00 s, "
      "compile 5.00 s, checkpoint 4.00 s, eval 3.00 s; 0 steps recomputed; 79.17 per million tokens at "
      "train.gpu_hour_price.")
  # a rollback from step 4 to step 2: steps 3 and 4 (3 s of productive time) are lost
  g.rewind(2, 4)
  row = g.row(2)
  assert (row["goodput_productive_s"], row["badput_lost_s"], row["lost_steps"]) == (2, 3, 2)
  assert row["goodput_productive_s"] + sum(row[k] for k in BUCKETS) == row["goodput_wall_s"]
  # between logged steps the productive time is interpolated
  g = goodput_lib.Goodput(clock)
  g.trail = [(10, 4.0), (20, 9.0)]
  assert (g.productive_at(10), g.productive_at(14), g.productive_at(20), g.productive_at(25)) == (4.0, 6.0, 9.0, 9.0)


def test_resume_reads_the_trajectory_and_counts_recomputed_steps():
  rows = [  # run 1: steps 1..6, crashed after logging step 6; run 2 resumed at 4 and logged 5, 6, 7, then crashed
      *({"step": s, "goodput_wall_s": 10 + s, "goodput_productive_s": float(s), **dict.fromkeys(BUCKETS, 1.0),
         "lost_steps": 0, "restarts": 0} for s in range(1, 7)),
      {"step": 4, "event": "checkpoint_restore", "restore_s": 0.5},
      *({"step": s, "goodput_wall_s": 20 + s, "goodput_productive_s": 10.0 + s, **dict.fromkeys(BUCKETS, 2.0),
         "lost_steps": 2, "restarts": 1} for s in (5, 6, 7)),
  ]
  clock = FakeClock()
  g = goodput_lib.Goodput(clock)
  g.resume(rows, 6)  # run 3 restores step 6 (written by run 2): step 7 is lost, at 17 - 16 s
  clock.t = 1.0
  row = g.row(6)
  assert row["lost_steps"] == 3 and row["restarts"] == 2
  assert row["badput_lost_s"] == pytest.approx(2.0 + 1.0) and row["goodput_productive_s"] == pytest.approx(16.0)
  assert row["goodput_wall_s"] == 28.0
  g = goodput_lib.Goodput(clock)
  g.resume(rows, 3)  # back to step 3: run 2's trajectory runs 1..4 (run 1), 5..7 (run 2): 3 -> 7 costs 17 - 3 s
  assert g.lost_steps == 2 + 4 and g.bad["lost"] == pytest.approx(2.0 + 14.0) and g.productive == pytest.approx(3.0)
  g = goodput_lib.Goodput(clock)
  g.resume([{"step": 3, "loss": 1.0}], 3)  # a workdir written before goodput existed: nothing to carry over
  assert g.row(3)["goodput_wall_s"] == 0.0 and g.restarts == 0 and g.lost_steps == 0


def test_trapezoid_energy_against_the_exact_integral():
  clock = FakeClock()
  meter = goodput_lib.EnergyMeter(lambda: 100 + 50 * clock.t, clock=clock, scale=2.0)
  times = np.cumsum(np.random.default_rng(0).uniform(0.01, 0.3, size=40))
  for t in times:  # irregular intervals, as a loaded thread samples: a linear power is still integrated exactly
    clock.t = t
    meter.sample()
  a, b = times[0], times[-1]
  assert meter.joules() == pytest.approx(2 * (100 * (b - a) + 25 * (b * b - a * a)), rel=1e-12)
  assert meter.watts == pytest.approx(2 * (100 + 50 * b))
  # a curved power: the trapezoid rule of numpy over the same samples
  clock.t, meter = 0.0, goodput_lib.EnergyMeter(lambda: 300 * np.sin(clock.t) ** 2, clock=clock)
  for t in times:
    clock.t = t
    meter.sample()
  p = 300 * np.sin(times) ** 2
  assert meter.joules() == pytest.approx(float(np.sum((p[1:] + p[:-1]) / 2 * np.diff(times))), rel=1e-12)


def test_background_sampling_thread_covers_start_to_stop():
  meter = goodput_lib.EnergyMeter(lambda: 250.0, interval_s=0.01)
  start = time.perf_counter()
  meter.start()
  time.sleep(0.2)
  meter.stop()
  elapsed = time.perf_counter() - start
  assert 250 * 0.2 <= meter.joules() <= 250 * elapsed  # constant power: exact over first to last sample
  g = goodput_lib.Goodput()
  g.energy = meter
  row = g.row(2, tokens_per_step=50)
  assert row["energy_j"] == meter.joules() and row["joules_per_token"] == meter.joules() / 100


def test_no_nvml_reader_on_cpu():
  assert goodput_lib.gpu_energy_meter() is None


# ---- real runs ----

def _rows(workdir):
  return jaxtrain.read_metrics(workdir, as_frame=False)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
  """6 steps on one device, eval every 3, saves every 2: (workdir, rows, seconds train() took)."""
  workdir = str(tmp_path_factory.mktemp("goodput") / "run")
  start = time.perf_counter()
  jaxtrain.train(_config(6), workdir, progress=False, devices=jax.devices()[:1])
  return workdir, _rows(workdir), time.perf_counter() - start


def _config(steps):
  cfg = tiny_config()
  cfg.train.update(steps=steps, eval_every=3, gpu_hour_price=2.5)
  cfg.checkpoint.every_steps = 2
  return cfg


def _adds_up(row):
  """The buckets cover the wall time: the only time outside them is the bookkeeping after the last boundary
  (writing the save records' rows, reading the clock), milliseconds; 0.25 s allows a descheduling on a loaded host."""
  assert row["goodput_productive_s"] + sum(row[k] for k in BUCKETS) == pytest.approx(row["goodput_wall_s"], abs=0.25)
  assert row["goodput"] == pytest.approx(row["goodput_productive_s"] / row["goodput_wall_s"], rel=1e-6)


def test_run_rows_add_up_and_eval_and_saves_land_in_their_buckets(run_a):
  _, rows, outside = run_a
  steps = [r for r in rows if "event" not in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
  for r in steps:  # a step row is written before its own iteration's boundary: the buckets stay below the wall
    assert r["goodput_productive_s"] + sum(r[k] for k in BUCKETS) <= r["goodput_wall_s"]
    assert "energy_j" not in r  # CPU: no power columns
  final = rows[-1]
  assert final["event"] == "goodput" and final["step"] == 6
  _adds_up(final)
  assert 0 < final["goodput_wall_s"] <= outside
  # eval: the bucket holds the evaluations (eval_time_s is timed inside the same boundaries)
  evals = sum(r.get("eval_time_s", 0.0) for r in steps)
  assert evals > 0 and evals <= final["badput_eval_s"] <= evals + 0.25
  # checkpoints: the loop blocked at least for every save's blocking part (saves at 2, 4 and the final 6)
  saves = [r for r in rows if r.get("event") == "checkpoint_save"]
  assert [r["step"] for r in saves] == [2, 4, 6]
  assert final["badput_checkpoint_s"] >= sum(r["save_blocking_s"] for r in saves) > 0
  # compile: inside the first row's step time, which starts its window before compiling
  assert 0 < final["badput_compile_s"] <= steps[0]["step_time_s"]
  assert final["badput_restore_s"] == 0 and final["lost_steps"] == 0 and final["badput_lost_s"] == 0
  tokens = 6 * 8 * 16
  assert final["cost_per_mtok"] == pytest.approx(2.5 * final["goodput_wall_s"] / 3600 / (tokens / 1e6), rel=1e-9)


@pytest.mark.slow
def test_resume_counts_restore_time_and_recomputed_steps(run_a, tmp_path):
  """Run a's newest checkpoint (6) deleted, as when a run dies before its final save; run b resumes from step 4
  and trains to 8."""
  workdir = str(tmp_path / "run")
  shutil.copytree(run_a[0], workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  rows_a = run_a[1]
  start = time.perf_counter()
  final = jaxtrain.train(_config(8), workdir, progress=False, devices=jax.devices()[:1])
  outside_b = time.perf_counter() - start
  rows_b = _rows(workdir)[len(rows_a):]
  restore = next(r for r in rows_b if r.get("event") == "checkpoint_restore")
  assert restore["step"] == 4
  end_a, end_b = rows_a[-1], rows_b[-1]
  assert end_b["event"] == "goodput" and end_b["step"] == 8 and final["goodput"] == end_b["goodput"]
  _adds_up(end_b)
  assert end_b["restarts"] == 1 and end_b["lost_steps"] == 2  # steps 5 and 6 ran twice
  row_4 = next(r for r in rows_a if r["step"] == 4 and "event" not in r)
  lost = end_a["goodput_productive_s"] - row_4["goodput_productive_s"]  # what steps 5 and 6 took in run a
  assert end_b["badput_lost_s"] == pytest.approx(lost, rel=1e-9)
  assert end_b["badput_restore_s"] >= restore["restore_s"] > 0
  for name in ("init", "compile", "eval"):  # run b adds its own to run a's
    assert end_b[f"badput_{name}_s"] > end_a[f"badput_{name}_s"]
  assert 0 < end_b["goodput_wall_s"] - end_a["goodput_wall_s"] <= outside_b


def test_compare_runs_shows_the_final_totals(run_a):
  from tools.compare_runs import compare
  workdir, rows, _ = run_a
  header, (cells,) = compare([workdir])
  final = rows[-1]
  assert header[header.index("mfu") + 1:] == ["goodput", "goodput_productive_s", "badput_compile_s",
                                               "badput_checkpoint_s", "badput_restore_s", "badput_eval_s",
                                               "badput_lost_s", "lost_steps", "cost_per_mtok"]  # no energy on CPU
  shown = dict(zip(header, cells))
  assert shown["goodput"] == f"{final['goodput']:.1%}" and shown["lost_steps"] == "0"
  assert shown["badput_checkpoint_s"] == f"{final['badput_checkpoint_s']:.2f}"  # the end's, final save included
  assert shown["cost_per_mtok"] == f"{final['cost_per_mtok']:.4g}"


def test_the_trail_stays_bounded_and_interpolates(monkeypatch):
  monkeypatch.setattr(goodput_lib, "TRAIL", 8)
  clock = FakeClock()
  g = goodput_lib.Goodput(clock)
  for step in range(1, 101):
    clock.t += 1.0
    g.charge("step", step)
    g.charge("step", step)  # a second boundary of the same step (an eval, a save) adds no entry
  assert len(g.trail) <= 16 and g.trail[-8:] == [(s, float(s)) for s in range(93, 101)]
  assert g.productive_at(37) == 37.0  # one second a step: exact between thinned entries
  g.rewind(40, 100)
  assert (g.productive, g.bad["lost"], g.lost_steps) == (40.0, 60.0, 60)
