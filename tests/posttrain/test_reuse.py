"""Rollout reuse (posttrain.ppo_epochs, posttrain.minibatches): every epoch's minibatches cover the
rollout batch once, in a new order; the store keeps the newest batches and says what to do when one
is gone; on the loop the ratio moves and the clips bind after the first minibatch (and never at
it), the fault counts are counted once a rollout, and a run resumed mid-epoch is bitwise the
uninterrupted one (slow)."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import config as config_lib, metrics
from jaxtrain.builder import TASKS
from jaxtrain.posttrain import reuse, rl

from tests.posttrain.test_dpo import restore
from tests.posttrain.test_grpo import broken, digit_share, rl_config


def test_every_epoch_covers_the_rollout_once_in_a_new_order():
  s = reuse.Schedule(epochs=3, minibatches=4, samples=32, seed=7)
  assert s.steps_per_rollout == 12 and s.rows == 8
  for rollout in (0, 5):
    epochs = []
    for epoch in range(3):
      parts = [s.minibatch_rows(rollout * 12 + epoch * 4 + m) for m in range(4)]
      assert all(len(p) == 8 for p in parts)
      np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(32))
      epochs.append(parts[0])
    assert not np.array_equal(epochs[0], epochs[1])
  assert s.where(25) == (2, 1)
  np.testing.assert_array_equal(s.minibatch_rows(13), s.minibatch_rows(13))  # a function of the step
  assert not np.array_equal(s.minibatch_rows(1), s.minibatch_rows(13))  # another rollout, another order


def test_store_keeps_the_newest_and_names_a_missing_one(tmp_path):
  store = reuse.Store(str(tmp_path / "rl_rollouts"), keep=2)
  for r in range(4):
    store.save(r, {"tokens": np.full((2, 3), r, np.int32), "reward": np.arange(2, dtype=np.float32) + r})
  assert sorted(os.listdir(tmp_path / "rl_rollouts")) == ["rollout_00000002.npz", "rollout_00000003.npz"]
  got = store.load(3, step=13)
  np.testing.assert_array_equal(got["tokens"], np.full((2, 3), 3))
  assert got["reward"].dtype == np.float32
  with pytest.raises(config_lib.ConfigError, match="rollout batch 1.*rollout boundary"):
    store.load(1, step=5)


def test_sampled_logprobs_renormalize_over_the_top_k():
  logits = jnp.asarray([[[2.0, 1.0, 0.5, -1.0, 3.0]]])
  full = np.log(np.exp(np.asarray(logits[0, 0], np.float64)) / np.exp(np.asarray(logits[0, 0], np.float64)).sum())
  kept = np.asarray([2.0, 3.0])  # the top 2
  norm = np.log(np.exp(kept).sum())
  for target, want in ((4, 3.0 - norm), (0, 2.0 - norm), (2, 0.5 - norm)):  # 2: outside the top k, still finite
    got = rl.sampled_logprobs(logits, jnp.asarray([[target]]), top_k=2)
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-6)
  np.testing.assert_allclose(rl.sampled_logprobs(logits, jnp.asarray([[1]]), top_k=0)[0, 0], full[1], rtol=1e-6)
  grad = jax.grad(lambda x: rl.sampled_logprobs(x, jnp.asarray([[2]]), top_k=2).sum())(logits)
  assert np.all(np.isfinite(grad)) and grad[0, 0, 3] == 0.0  # a token outside the top k adds nothing


def test_reuse_and_top_p_are_checked():
  cfg = rl_config(minibatches=3)  # 16 samples do not split into 3
  with pytest.raises(config_lib.ConfigError, match="minibatches=3"):
    config_lib.validate(cfg, 8)
  cfg = rl_config(minibatches=4)  # 4 rows a minibatch over 8 data-parallel devices
  cfg.mesh.update(data=8)
  with pytest.raises(config_lib.ConfigError, match="8 data-parallel"):
    config_lib.validate(cfg, 8)
  with pytest.raises(config_lib.ConfigError, match="top_p=0.9"):
    config_lib.validate(rl_config("ppo", top_p=0.9), 8)
  config_lib.validate(rl_config(ppo_epochs=2, minibatches=2, top_k=5), 8)


@pytest.mark.slow  # two short RL runs
@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_ppo_epochs_move_the_ratio_and_the_clips_bind(tmp_path, task):
  """4 epochs x 2 minibatches: at a rollout's first step the params are the sampler's (ratio 1,
  nothing clipped); at its later steps they are not, and with a large learning rate the clips bind."""
  cfg = rl_config(task, temperature=1.0, kl_coef=0.05, ppo_epochs=4, minibatches=2, clip_eps=0.1, top_k=20,
                  **({"value_clip": 0.01} if task == "ppo" else {}))
  cfg.train.update(steps=16, batch_size=16 if task == "ppo" else 8)
  cfg.optim.update(lr=1e-2, warmup_steps=1, schedule="constant", weight_decay=0.0)
  rewards = [digit_share, broken]  # learnable from the init; a faulty function counted once a rollout
  task_obj = TASKS[task](cfg, str(tmp_path), rewards=rewards)
  jaxtrain.train(cfg, str(tmp_path), task=task_obj, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(str(tmp_path)) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, 17))
  first = [r for r in rows if (r["step"] - 1) % 8 == 0]
  later = [r for r in rows if (r["step"] - 1) % 8]
  for r in first:
    assert abs(r["ratio_mean"] - 1.0) < 1e-5 and r["clip_fraction"] == 0.0, r
    assert r["reward_faults_raised"] == 16  # every sample of the rollout, counted on its first step
  assert all(r["reward_faults_raised"] == 0 for r in later)
  assert max(abs(r["ratio_mean"] - 1.0) for r in later) > 1e-3
  assert max(r["clip_fraction"] for r in later) > 0.0
  if task == "ppo":
    assert all(r["value_clip_fraction"] == 0.0 for r in first)  # V equals V_old there
    assert max(r["value_clip_fraction"] for r in later) > 0.0
  assert sorted(os.listdir(tmp_path / "rl_rollouts")) == ["rollout_00000000.npz", "rollout_00000001.npz"]


@pytest.mark.slow  # three runs
def test_resume_mid_epoch_is_bitwise(tmp_path):
  """2 epochs x 2 minibatches, 8 steps, a checkpoint every 3: the resumed run starts at step 6, the
  third minibatch of rollout batch 1, which it reads back from WORKDIR/rl_rollouts."""
  cfg = rl_config(temperature=1.0, kl_coef=0.1, ppo_epochs=2, minibatches=2, top_k=50)
  cfg.mesh.update(data=2, fsdp=4)
  cfg.train.steps = 8
  cfg.checkpoint.update(every_steps=3)
  cfg.optim.update(lr=3e-3, warmup_steps=1)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(straight) if "loss" in r]
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["step"] for r in again] == [7, 8]

  def untimed(row):  # every value but the clock's
    return {k: v for k, v in row.items()
            if k not in ("step_time_s", "tokens_per_sec", "mfu", "goodput") and not k.startswith(("goodput_", "badput_"))}

  assert [untimed(r) for r in again] == [untimed(r) for r in rows[-2:]]
  a, b = jax.device_get(restore(cfg, straight).params), jax.device_get(restore(cfg, resumed).params)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert any(abs(r["ratio_mean"] - 1.0) > 1e-6 for r in rows[-2:])
