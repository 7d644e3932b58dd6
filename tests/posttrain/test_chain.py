"""The whole post-training chain on the exact task (issue 13 item 6), `experiments/posttrain/run.py --study
chain` (its CHAIN budget, the README's run): pre-training on 2-digit additions with 20% wrong answers, SFT on
200 clean problems from the earliest kept base step that SFT makes partly right, then GRPO and PPO from the
same SFT model with an exact-match reward. Both must raise held-out greedy exact match over the SFT model by
at least 20 points and log their reward curve and KL every step.

Measured (README, AMD EPYC, seed 0): base step 350 (23.0%) -> SFT step 30 41.5% -> GRPO 63.5% (+22.0), PPO
78.5% (+37.0) after 200 steps of 256 samples at temperature 0.7; ~15 min on 2 cores (`long`)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures import ROOT

SCRIPT = os.path.join(ROOT, "experiments", "posttrain", "run.py")


@pytest.mark.slow
@pytest.mark.long  # ~15 min: `make test-long`
def test_grpo_and_ppo_raise_exact_match_over_the_sft_model(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device, as from the command line
  subprocess.run([sys.executable, SCRIPT, "--study", "chain", "--out", str(tmp_path), "--results", str(tmp_path)],
                 check=True, env=env, cwd=ROOT, capture_output=True, timeout=3000)
  r = json.load(open(tmp_path / "chain" / "results.json"))
  acc = {s["stage"].split()[0]: s["accuracy"] for s in r["stages"]}
  assert list(acc) == ["pre-train", "SFT", "GRPO", "PPO"]
  assert r["eval_prompts"] == 200 and r["noise"] == 0.2
  search = r["base_search"]  # bases tried in order until SFT from one reaches the target on the RL-side prompts
  assert [x["base_step"] for x in search] == list(range(300, 300 + 50 * len(search), 50))
  assert max(search[-1]["sft_rl_prompt_accuracy"]) >= r["sft_target"]
  assert all(max(x["sft_rl_prompt_accuracy"]) < r["sft_target"] for x in search[:-1])
  assert acc["SFT"] < 0.8  # the SFT model is clearly below the ceiling: room for RL
  assert acc["GRPO"] >= acc["SFT"] + 0.20  # the target
  assert acc["PPO"] >= acc["SFT"] + 0.20
  for task in ("grpo", "ppo"):
    steps = r["rl"][task]["steps"]
    assert [s["step"] for s in steps] == list(range(1, 201))  # every step logged
    reward, std, kl = (np.array([s[k] for s in steps]) for k in ("reward_mean", "reward_std", "kl"))
    assert np.all((reward >= 0) & (reward <= 1)) and np.all(std >= 0)
    # a 0/1 reward: its spread over a step's samples is that of a Bernoulli with the step's mean
    np.testing.assert_allclose(std, np.sqrt(reward * (1 - reward)), atol=2e-3)
    assert np.all(np.isfinite(kl)) and np.all(kl >= 0) and kl[-10:].mean() > kl[:3].mean()  # drifts from the reference
    stats = r["rl"][task]["reward_stats"]
    assert stats["last_mean"] > stats["first_mean"]
  for name in ("chain.png", "rl.png"):
    assert (tmp_path / "chain" / name).stat().st_size > 1000
