"""experiments/precision and experiments/scaling: the measures each study computes, against hand-made inputs
(default); and each study's command with --quick (slow: ~9 compiles and trainings), whose tables and plots
must agree with the runs' own metrics.jsonl, recomputed here."""

import importlib.util
import json
import os
import statistics
import types

import pytest

from tests.fixtures import ROOT

PNG = b"\x89PNG\r\n\x1a\n"


def load(study: str):
  path = os.path.join(ROOT, "experiments", study, "run.py")
  spec = importlib.util.spec_from_file_location(f"_{study}_run", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def logged(workdir: str) -> list[dict]:
  """metrics.jsonl's step rows, read without jaxtrain."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in rows if "event" not in r and "loss" in r]


@pytest.mark.slow
@pytest.mark.long  # 56 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_precision_quick(tmp_path):
  results = load("precision").main(["--quick", "--root", str(tmp_path / "runs"), "--out", str(tmp_path)])
  f32, bf16 = (logged(str(tmp_path / "runs" / name)) for name in ("float32", "bfloat16"))
  diffs = [b["loss"] - a["loss"] for a, b in zip(f32, bf16, strict=True)]
  div = results["divergence"]
  assert div["max_abs"] == pytest.approx(max(abs(d) for d in diffs), abs=1e-12)
  assert div["final"] == pytest.approx(diffs[-1], abs=1e-12)
  assert 0 < div["max_abs"] < 0.05  # bf16 compute took effect, and stays close on 4 steps
  evals = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(f32, bf16) if "eval_loss" in a]
  assert div["eval_final"] == pytest.approx(evals[-1][1] - evals[-1][0], abs=1e-12)
  config = json.load(open(tmp_path / "runs" / "bfloat16" / "config.json"))
  assert (config["model"]["compute_dtype"], config["model"]["param_dtype"]) == ("bfloat16", "float32")
  for name, speed in results["speed"].items():
    assert len(speed["times"]) == results["repeats"] and speed["median_step_s"] == statistics.median(speed["times"])
    assert speed["tokens_per_sec"] == pytest.approx(2 * 64 / speed["median_step_s"])
  table = open(tmp_path / "table.md").read()
  assert f"{div['max_abs']:.4f} (step {div['max_step']})" in table and "| bfloat16 |" in table
  for png in ("precision.png", "curves.png"):
    assert open(tmp_path / png, "rb").read(8) == PNG


def fake_planner(memory: float, step_time: float):
  plan = types.SimpleNamespace(memory={"total": memory}, step_time_s=step_time)
  return types.SimpleNamespace(predict=lambda cfg, n_devices=None, device_kind=None: plan)


@pytest.mark.slow
@pytest.mark.long  # 97 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_scaling_quick(tmp_path, monkeypatch):
  run = load("scaling")
  monkeypatch.setattr(run, "load_planner", lambda: fake_planner(2**20, 0.5))
  results = run.main(["--quick", "--root", str(tmp_path / "runs"), "--out", str(tmp_path)])
  study = run.load_study_config()
  assert [p["devices"] for p in results["devices"]] == list(study.QUICK_DEVICES)
  assert [p["name"] for p in results["sizes"]] == list(study.ARGS)
  for p in results["sizes"] + results["devices"]:
    rows = logged(os.path.join(ROOT, p["workdir"]))
    assert len(rows) == p["steps"] == 3
    median = statistics.median(r["step_time_s"] for r in rows[1:-1])  # not the compile, nor the empty last
    assert p["tokens_per_sec"] == pytest.approx(p["tokens_per_step"] / median)
    # params, gradient-free: the step's arguments hold at least params + AdamW's two moments in float32
    assert p["memory"]["arguments"] >= 3 * 4 * p["params"]
    assert p["memory"]["total"] == (p["memory"]["arguments"] + p["memory"]["outputs"] - p["memory"]["aliased"]
                                    + p["memory"]["temporaries"])
  params = [p["params"] for p in results["sizes"]]
  assert params == sorted(params) and len(set(params)) == 3
  # data parallel: the same global batch split over more devices needs fewer temporaries per device
  temps = [p["memory"]["temporaries"] for p in results["devices"]]
  assert temps[-1] < temps[0]
  table = open(tmp_path / "table.md").read()
  one = results["devices"][0]
  assert f"| {one['memory']['total'] / 2**20:.2f} |" in table  # measured / planner, the planner saying 1 MiB
  assert f"| {one['median_step_s'] / 0.5:.2f} |" in table
  without = run.format_table([{**p, "predicted": None} for p in results["sizes"]], study, "size")
  assert without.count("| - | - | - | - |") == 3
  assert open(tmp_path / "scaling.png", "rb").read(8) == PNG


def test_time_to_target():
  run = load("scaling")
  rows = [{"step": s, "loss": loss, "step_time_s": t}
          for s, loss, t in [(1, 6.0, 9.0), (2, 5.0, 1.0), (3, 4.0, 2.0), (4, 3.0, 3.0)]]
  assert run.time_to_target(rows, 1.5, 4.5, 2) == (3, 1.5 + 1.0 + 2.0)  # mean(5, 4) <= 4.5 first at step 3
  assert run.time_to_target(rows, 1.5, 2.0, 2) == (None, None)


def test_divergence():
  run = load("precision")
  ref = {"loss": {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}, "eval_loss": {2: 4.5, 4: 2.5}}
  other = {"loss": {1: 5.0, 2: 4.1, 3: 2.8, 4: 2.05}, "eval_loss": {2: 4.4, 4: 2.6}}
  div = run.divergence(ref, other)
  assert (div["max_step"], div["final_step"], div["steps"]) == (3, 4, 4)
  assert div["max_abs"] == pytest.approx(0.2) and div["final"] == pytest.approx(0.05)
  assert div["mean_abs"] == pytest.approx((0 + 0.1 + 0.2 + 0.05) / 4)
  assert div["mean_abs_last_quarter"] == pytest.approx(0.05)
  assert div["eval_final"] == pytest.approx(0.1) and div["eval_max_abs"] == pytest.approx(0.1)
  assert div["loss_drop_ref"] == pytest.approx(3.0)


def point(name: str, devices: int, median: float, total: int, predicted=None) -> dict:
  memory = {"arguments": total // 2, "outputs": total // 2, "aliased": 0, "temporaries": 0, "total": total}
  return {"name": name, "devices": devices, "params": 1_000_000, "tokens_per_step": 256, "steps": 20,
          "median_step_s": median, "tokens_per_sec": 256 / median, "memory": memory, "peak_rss": 2**30,
          "final_loss": 5.0, "steps_to_target": None, "time_to_target_s": None, "predicted": predicted}


def test_scaling_table_ratios():
  run = load("scaling")
  study = run.load_study_config()
  rows = run.format_table([point("tiny", 1, 0.2, 3 * 2**20, {"memory_total": 2**20, "step_time_s": 0.1}),
                           point("small_20m", 1, 0.4, 2**20)], study, "size").splitlines()
  cells = [c.strip() for c in rows[2].split("|")[1:-1]]
  head = [c.strip() for c in rows[0].split("|")[1:-1]]
  by = dict(zip(head, cells))
  assert (by["measured/planner mem"], by["measured/planner step"], by["planner MiB"]) == ("3.00", "2.00", "1.0")
  assert by[f"steps to loss {study.TARGET}"] == "not reached in 20 steps"
  assert rows[3].count("| - |") >= 2 and "| - | - | - | - |" in rows[3]  # no planner: its four columns
