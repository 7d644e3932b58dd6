"""experiments/posttrain/rl_must_win.py (issue 25 item 2): its prompt sets are disjoint and the SFT set
holds no problem with a ones carry while the test set does; the arms are chosen on validation alone;
the quick budget runs end to end (slow)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures import ROOT

SCRIPT = os.path.join(ROOT, "experiments", "posttrain", "rl_must_win.py")


def _module():
  spec = importlib.util.spec_from_file_location("rl_must_win", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_splits_are_disjoint_and_sft_never_shows_a_ones_carry():
  m = _module()
  s = m.splits(m.BUDGET, seed=0)
  assert {k: len(v) for k, v in s.items()} == {"test": 200, "val": 200, "rl": 1000, "sft": 200}
  prompts = {k: {r["prompt"] for r in v} for k, v in s.items()}
  assert not prompts["val"] & prompts["rl"] and not prompts["val"] & prompts["sft"]
  assert not prompts["test"] & (prompts["val"] | prompts["rl"] | prompts["sft"])  # held out by hash
  assert not any(m.ones_carry(p) for p in prompts["sft"])
  share = sum(m.ones_carry(p) for p in prompts["test"]) / 200
  assert 0.3 < share < 0.6  # the harder half is in the test set, never demonstrated
  assert m.ones_carry("17+25=") and not m.ones_carry("12+35=")


@pytest.mark.slow  # a tiny pre-training, SFT and three arms: about a minute
@pytest.mark.long  # 156 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_quick_budget_runs_and_chooses_on_validation(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  subprocess.run([sys.executable, SCRIPT, "--quick", "--seeds", "0", "--out", str(tmp_path)], check=True, env=env,
                 cwd=ROOT, capture_output=True, timeout=1200)
  r = json.load(open(tmp_path / "results.json"))
  (seed,) = r["seeds"]
  assert seed["best_sft"] == max(seed["sft_curve"], key=lambda x: (x["val"], -x["step"]))
  for arm in ("sft_continued", "grpo", "ppo"):
    a = seed["arms"][arm]
    assert a["chosen"] == max(a["curve"], key=lambda x: (x["val"], -x["step"])) and a["last"] == a["curve"][-1]
    assert r["summary"][arm]["gain_points"] == [round(100 * (a["chosen"]["test"] - seed["best_sft"]["test"]), 1)]
  assert (tmp_path / "rl_must_win.png").stat().st_size > 1000 and (tmp_path / "table.md").is_file()


@pytest.mark.slow  # a tiny pre-training, SFT, a reward model, PPO and GRPO: about two minutes
@pytest.mark.long  # 140 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_rm_chain_quick_budget_tracks_learned_and_gold_reward(tmp_path):
  """experiments/posttrain/rm_chain.py (issue 25 item 3): RL on the reward model's score alone, the gold
  (exact match) logged beside it every step."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  script = os.path.join(ROOT, "experiments", "posttrain", "rm_chain.py")
  subprocess.run([sys.executable, script, "--quick", "--seeds", "0", "--out", str(tmp_path)], check=True, env=env,
                 cwd=ROOT, capture_output=True, timeout=1200)
  r = json.load(open(tmp_path / "results.json"))
  (seed,) = r["seeds"]
  assert 0.0 <= seed["rm"]["eval_accuracy"] <= 1.0 and seed["rm"]["pairs"] == 64
  for task in ("ppo", "grpo"):
    m = seed["methods"][task]
    assert [x["step"] for x in m["steps"]] == [1, 2]
    assert all(0.0 <= x["gold"] <= 1.0 and np.isfinite(x["learned"]) for x in m["steps"])
    assert len({x["learned"] for x in m["steps"]}) > 1  # the RM's score, not the 0/1 exact match
  assert (tmp_path / "rm_chain.png").stat().st_size > 1000
