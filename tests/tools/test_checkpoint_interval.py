"""experiments/checkpoint_interval/run.py: failure draws and the replay of save policies against hand-worked
schedules (fast), and the whole script at its --quick budget, whose real failing runs must recompute what the
replay says (slow)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures import ROOT

SCRIPT = os.path.join(ROOT, "experiments", "checkpoint_interval", "run.py")


@pytest.fixture(scope="module")
def run():
  spec = importlib.util.spec_from_file_location("checkpoint_interval_run", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def calm(steps: int, spike_at: int | None = None) -> dict:
  """A smoothly falling loss, with one spike if asked."""
  return {s: (10.0 if s == spike_at else 3.0 - 0.01 * s, 1.0, 0.0) for s in range(1, steps + 1)}


def test_failure_draws_are_seeded_geometric_gaps(run):
  a = run.failure_steps(20, 3, 40_000)
  assert a == run.failure_steps(20, 3, 40_000) and a != run.failure_steps(20, 4, 40_000)
  gaps = np.diff([0, *a])
  assert gaps.min() >= 1 and a[-1] >= 40_000 and a[-2] < 40_000
  assert gaps.mean() == pytest.approx(20, rel=0.05)  # ~2,000 gaps: the mean's standard error is ~2%


def test_fixed_interval_replay_by_hand(run):
  new = lambda: run.Fixed(5)  # noqa: E731
  assert run.replay(calm(20), new, [], 20) == {"recomputed": 0, "saves": 3, "restarts": 0, "computed": 20}
  # fails after step 7 (saved: 5): back to 5; the 13th computed step is step 11 (saved: 10): back to 10
  assert run.replay(calm(20), new, [7, 13], 20) == {"recomputed": 3, "saves": 3, "restarts": 2, "computed": 23}
  assert run.replay(calm(20), new, [10, 40], 20)["recomputed"] == 0  # a failure right after a save loses nothing
  assert run.replay(calm(20), new, [20], 20)["restarts"] == 0  # the run had finished


def test_adaptive_replay_by_hand(run):
  new = lambda: run.Adaptive(2, 8, 0.1)  # noqa: E731
  # calm: saves at 2, 6, 14, 22 (the interval doubles 2 -> 4 -> 8); 30 is the last step (its save is forced)
  assert run.replay(calm(30), new, [], 30)["saves"] == 4
  # a spike at 16 (seen while step 17 runs): the interval drops to 2: saves at 17, 19 (calm: 4), 23 (8)
  assert run.replay(calm(30, spike_at=16), new, [], 30)["saves"] == 6
  # a failure after step 10 (saved: 6) restarts a fresh policy: saves at 8, 12, 20, 28 after 2, 6
  assert run.replay(calm(30), new, [10], 30) == {"recomputed": 4, "saves": 6, "restarts": 1, "computed": 34}
  # saves in flight for 3 steps: the spike's interval of 2 waits: saves at 2, 6, 14, 17, 20 (calm: 4), 24 (8)
  assert run.replay(calm(30, spike_at=16), new, [], 30, busy=3)["saves"] == 6
  assert run.replay(calm(30, spike_at=16), new, [], 30, busy=5)["saves"] == 5  # 2, 7 (8), 15, 20 (the spike: 2), 25
  fixed = lambda: run.Fixed(5)  # noqa: E731
  assert run.replay(calm(30), fixed, [], 30, busy=8) == run.replay(calm(30), fixed, [], 30)  # never waits


def test_table_and_plot_of_a_result(run, tmp_path):
  rows = [{"policy": p, "mtbf": m, "saves": s, "restarts": 2.0, "recomputed": r, "recomputed_per_failure": r / 2,
           "overhead_s": 1.0} for m in (10, 20) for p, s, r in (("fixed_5", 5, 4), ("fixed_10", 2, 9),
                                                              ("adaptive_10_200", 3, 7))]
  real = {"recomputed": 3, "saves": 4, "restarts": 1, "goodput_lost_steps": 2, "goodput": 0.5, "wall_s": 3.0}
  result = {"steps": 30, "seeds": 5, "rows": rows, "real": [{"policy": "fixed_5", "mtbf": 9, "real": real,
                                                              "replay": {"recomputed": 3, "saves": 4}}]}
  text = run.table(result)
  assert text.count("\n| ") == len(rows) + 1 + 3 and "| fixed_5 | 3 / 3 / 3 | 4 / 4 / 4 | 1 | 2 | 50.0% | 3.0 |" in text
  readme = tmp_path / "README.md"
  readme.write_text(f"# x\n{run.MARKERS[0]}\nold\n{run.MARKERS[1]}\nafter\n")
  run.update_readme(str(readme), text)
  assert readme.read_text() == f"# x\n{run.MARKERS[0]}\n{text}{run.MARKERS[1]}\nafter\n"
  run.plot(result, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
def test_quick_run_real_failures_recompute_what_the_replay_says(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path), "--root", str(tmp_path / "runs")],
                 check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
  result = json.load(open(tmp_path / "results.json"))
  assert result["command"] == "python experiments/checkpoint_interval/run.py --quick"
  (real,) = result["real"]
  assert real["real"]["restarts"] >= 1
  for key in ("recomputed", "saves", "restarts"):
    assert real["real"][key] == real["replay"][key], key
  # goodput sees the recomputed steps that were logged: the step in flight when a run dies is not
  assert real["real"]["recomputed"] - real["real"]["restarts"] <= real["real"]["goodput_lost_steps"]
  assert real["real"]["goodput_lost_steps"] <= real["real"]["recomputed"]
  assert len(result["rows"]) == 2 * 6 and (tmp_path / "lost_work.png").stat().st_size > 1000
