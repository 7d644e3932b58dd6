"""Reward model: > 90% held-out accuracy on separable preferences (the chosen answer contains a marker
symbol), and the saved run loads as a reward function that scores like the task."""


import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain.posttrain import data, reward
from tests.fixtures import tiny_config
from tests.posttrain.test_sft import run_config

MARKER = 39


def marker_pairs(n: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    prompt = "< " + " ".join(map(str, rng.integers(30, size=3))) + " |"
    plain = rng.integers(30, size=3)
    marked = plain.copy()
    marked[rng.integers(3)] = MARKER
    rows.append({"prompt": prompt, "chosen": " ".join(map(str, marked)) + " >",
                 "rejected": " ".join(map(str, plain)) + " >"})
  return rows


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_reward_model_separates_marked_answers_and_loads_as_a_reward(tmp_path):
  train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  data.write_jsonl(marker_pairs(400, 0), str(train_path))
  data.write_jsonl(marker_pairs(64, 1), str(eval_path))
  cfg = tiny_config(data=dict(symbols=40), train=dict(task="rm", seq_len=16, batch_size=16, steps=25, eval_every=25,
                                                      eval_batches=4),
                    posttrain=dict(train_path=str(train_path), eval_path=str(eval_path)),
                    optim=dict(lr=3e-3, warmup_steps=3))
  workdir = str(tmp_path / "rm")
  final = jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  assert final["eval_accuracy"] > 0.9, final
  rm = jaxtrain.load_reward_model(workdir)
  held = marker_pairs(64, 1)
  chosen = rm.texts([r["prompt"] for r in held], [r["chosen"] for r in held])
  rejected = rm.texts([r["prompt"] for r in held], [r["rejected"] for r in held])
  assert chosen.shape == (64,) and np.mean(chosen > rejected) == final["eval_accuracy"]
  # the same scores as the task's own head on the eval batch
  task = reward.RewardModel(cfg, workdir)
  batch = next(task.batches("eval", 0, 16))
  b = {k: batch[k].reshape(32, 16) for k in ("tokens", "positions", "segment_ids")}
  want = np.asarray(reward.scores(task.model, jax.device_get(rm.params), b["tokens"], b["positions"],
                                  b["segment_ids"])).reshape(16, 2)
  np.testing.assert_allclose(want[:, 0], chosen[:16], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(want[:, 1], rejected[:16], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_rm_tiny_config_trains(tmp_path):
  final, rows = run_config("rm_tiny", str(tmp_path))
  assert len(rows) == 3 and abs(rows[0]["loss"] - np.log(2)) < 0.2 and {"eval_accuracy", "margin"} <= set(final)
  assert reward.load_reward_model(str(tmp_path)).texts(["< 1 2 |"], ["2 1 >"]).shape == (1,)
