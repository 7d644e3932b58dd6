"""PPO as a task on the loop: its loss equals the clipped policy and value formulas on independently computed
log-probs and values; the batch make_batch builds holds GAE (a loop implementation) of the KL-penalized
rewards over the value head's values; ppo_tiny runs as the CLI runs it (slow)."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxtrain.posttrain import Ppo
from jaxtrain.posttrain.ppo import HEAD
from tests.posttrain.test_grpo import RL_KEYS, batch_maker, fixed_batch, response_logp_np, rl_config, run_rl_config


def values_np(model, params, batch, width):
  """The value head on the decoder's final hidden states before each response token, float64."""
  decoder = {k: v for k, v in params.items() if k != HEAD}
  hidden = np.asarray(jax.jit(lambda p, *a: model.apply({"params": p}, *a, return_hidden=True))(
      decoder, batch["tokens"][:, :-1], batch["positions"][:, :-1], batch["segment_ids"][:, :-1]), np.float64)
  return hidden[:, width - 1:] @ np.asarray(params[HEAD]["w"], np.float64) + float(params[HEAD]["b"])


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_ppo_loss_equals_the_formulas(tmp_path):
  cfg = rl_config("ppo", temperature=0.8, clip_eps=0.2, value_clip=0.3, value_coef=0.5)
  task = Ppo(cfg, str(tmp_path))
  params = nn.unbox(jax.jit(task.init)(jax.random.key(0))[0])
  rng = np.random.default_rng(1)
  params[HEAD] = {"w": rng.normal(0, 0.5, params[HEAD]["w"].shape).astype(np.float32), "b": np.float32(0.1)}
  width, new, n = task.width, cfg.posttrain.max_new_tokens, 8
  batch = fixed_batch(rng, n, width, new)
  mask = batch["mask"]
  logp, logp_v = response_logp_np(task.model, {k: v for k, v in params.items() if k != HEAD}, batch, width, 0.8)
  values = values_np(task.model, params, batch, width)
  noise = lambda: rng.normal(0, 0.3, logp.shape)
  batch.update(logp_old=((logp + noise()) * mask).astype(np.float32),
               logp_ref=((logp + noise()) * mask).astype(np.float32),
               advantages=(rng.normal(size=logp.shape) * mask).astype(np.float32),
               values_old=((values + noise()) * mask).astype(np.float32),
               returns=((values + 3 * noise()) * mask).astype(np.float32), reward=rng.normal(size=n).astype(np.float32))
  value, sums = jax.jit(task.loss)(params, batch, {}, {})
  ratio = np.exp(logp - batch["logp_old"])
  a = batch["advantages"]
  policy = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
  v_clipped = batch["values_old"] + np.clip(values - batch["values_old"], -0.3, 0.3)
  vloss = 0.5 * np.maximum((values - batch["returns"]) ** 2, (v_clipped - batch["returns"]) ** 2)
  want = ((policy + 0.5 * vloss) * mask).sum()
  np.testing.assert_allclose(float(value), want, rtol=2e-5)
  np.testing.assert_allclose(float(sums["value_loss"]), (vloss * mask).sum(), rtol=2e-5)
  assert float(sums["count"]) == mask.sum()
  r = batch["logp_ref"] - logp
  np.testing.assert_allclose(float(sums["kl"]), ((np.exp(r) - r - 1) * mask).sum(), rtol=2e-5)
  entropy = -(np.exp(logp_v) * logp_v).sum(-1)
  np.testing.assert_allclose(float(sums["entropy"]), (entropy * mask).sum(), rtol=2e-5)


def gae_loop(rewards, values, length, gamma, lam):
  """GAE of one row over its first `length` tokens, the value after the last one 0."""
  adv, running = np.zeros(length), 0.0
  for t in reversed(range(length)):
    next_value = values[t + 1] if t + 1 < length else 0.0
    running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
    adv[t] = running
  return adv


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_make_batch_gae_of_kl_penalized_rewards(tmp_path):
  def first_digit(prompts, completions, **_):
    return [float(c[:1].isdigit()) for c in completions]

  cfg = rl_config("ppo", temperature=1.0, kl_coef=0.2, gamma=0.9, lam=0.8)
  cfg.mesh.update(data=2, fsdp=4)
  rng = np.random.default_rng(2)

  def tweak(state):  # a value head that says something, and a reference that differs from the policy
    head = {"w": jax.device_put(rng.normal(0, 0.5, state.params[HEAD]["w"].shape).astype(np.float32),
                                state.params[HEAD]["w"].sharding), "b": state.params[HEAD]["b"] + 0.2}
    reference = jax.tree.map(lambda x: x * 1.1, state.task_state["reference"])
    return state.replace(params={**state.params, HEAD: head}, task_state={"reference": reference})

  task = Ppo(cfg, str(tmp_path), rewards=first_digit)
  make = batch_maker(cfg, str(tmp_path), task, tweak)
  batch, logp = make(0)
  params = jax.device_get(make.state.params)
  mask, width = batch["mask"], task.width
  np.testing.assert_allclose(batch["logp_old"] * mask, logp * mask, atol=2e-5)
  values = values_np(task.model, params, batch, width) * mask
  np.testing.assert_allclose(batch["values_old"], values, atol=2e-5)
  reference = jax.device_get(make.state.task_state["reference"])
  logp_ref = response_logp_np(task.model, reference, batch, width, 1.0)[0] * mask
  np.testing.assert_allclose(batch["logp_ref"], logp_ref, atol=2e-5)
  assert np.abs(batch["logp_ref"] - batch["logp_old"]).max() > 1e-3
  lengths = mask.sum(1).astype(int)
  raw = np.zeros_like(mask, dtype=np.float64)
  for i, n in enumerate(lengths):
    rewards = -0.2 * (batch["logp_old"][i] - batch["logp_ref"][i])
    rewards[n - 1] += batch["reward"][i]
    raw[i, :n] = gae_loop(rewards, values[i], n, 0.9, 0.8)
  np.testing.assert_allclose(batch["returns"], (raw + values) * mask, rtol=1e-4, atol=1e-5)
  mean = raw[mask > 0].mean()
  whitened = (raw - mean) / np.sqrt(((raw - mean) ** 2)[mask > 0].mean() + 1e-8) * mask
  np.testing.assert_allclose(batch["advantages"], whitened, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # the tiny config's model compiles for a while
def test_ppo_tiny_config_trains(tmp_path):
  final, rows = run_rl_config("ppo_tiny", str(tmp_path))
  assert len(rows) == 2 and RL_KEYS | {"value_loss", "approx_kl"} <= set(final) and np.isfinite(final["loss"])
  assert rows[0]["kl"] == 0.0
