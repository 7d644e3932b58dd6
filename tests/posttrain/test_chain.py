"""The whole post-training chain on the exact task (issue 13 item 6), `experiments/posttrain/run.py --study
chain` (its CHAIN budget, the README's run): pre-training on 2-digit additions with 20% wrong answers, SFT on
200 clean problems, then GRPO and PPO from the same SFT model with an exact-match reward. Both must raise
held-out greedy exact match over the SFT model by at least 20 points and log their reward curve and KL every
step.

Measured (README): SFT 52.5% -> GRPO 80.0% (+27.5 points), PPO 81.5% (+29.0) after 200 steps of 256 samples at
temperature 0.7; the test asks for the issue's +20 from both."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures import ROOT, cpu_vendor

SCRIPT = os.path.join(ROOT, "experiments", "posttrain", "run.py")


@pytest.mark.slow
@pytest.mark.long  # 7-9 min: `make test-long`
@pytest.mark.xfail(cpu_vendor() != "GenuineIntel", strict=True,
                   reason="a known miss, measured 2026-12-02 on an AMD EPYC host: XLA:CPU's rounding there leaves "
                   "seed 0's model before its jump through pre-training and SFT (2.0%, SFT 6.5%), and RL from it adds "
                   "4-7 points (GRPO 10.5%, PPO 13.5%), as seeds 1 and 2 do on a Xeon (README). Issue 13 stays open "
                   "until the chain chooses its SFT length by the accuracy reached")
def test_grpo_and_ppo_raise_exact_match_over_the_sft_model(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device, as from the command line
  subprocess.run([sys.executable, SCRIPT, "--study", "chain", "--out", str(tmp_path), "--results", str(tmp_path)],
                 check=True, env=env, cwd=ROOT, capture_output=True, timeout=3000)
  r = json.load(open(tmp_path / "chain" / "results.json"))
  acc = {s["stage"].split()[0]: s["accuracy"] for s in r["stages"]}
  assert list(acc) == ["pre-train", "SFT", "GRPO", "PPO"]
  assert r["eval_prompts"] == 200 and r["noise"] == 0.2
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
