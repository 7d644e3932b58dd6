"""RL math (jaxtrain/posttrain/rl.py) against formulas written here in numpy: losses, their gradients, GAE
against a plain loop, group advantages, KL estimators, clip fractions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.posttrain import rl

B, T, V = 3, 5, 7


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(B, T, V)).astype(np.float32)
  targets = rng.integers(0, V, (B, T))
  logp_old = (rng.normal(size=(B, T)) * 0.3 - 1.5).astype(np.float32)
  logp_ref = (rng.normal(size=(B, T)) * 0.3 - 1.5).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], np.float32)
  adv = rng.normal(size=(B, T)).astype(np.float32)
  return dict(logits=logits, targets=targets, logp_old=logp_old, logp_ref=logp_ref, mask=mask, adv=adv)


def np_logp(logits, targets):
  z = logits - logits.max(-1, keepdims=True)
  logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return np.take_along_axis(logsm, targets[..., None], -1)[..., 0]


def test_token_logprobs_and_entropy(inputs):
  x = inputs["logits"]
  np.testing.assert_allclose(rl.token_logprobs(x, inputs["targets"]), np_logp(x, inputs["targets"]), rtol=1e-5)
  p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
  np.testing.assert_allclose(rl.entropy(x), -(p * np.log(p)).sum(-1), rtol=1e-5)


def test_kl_estimators(inputs):
  lp, lr = inputs["logp_old"] + 0.2, inputs["logp_ref"]
  np.testing.assert_allclose(rl.kl_k1(lp, lr), lp - lr, rtol=1e-6)
  np.testing.assert_allclose(rl.kl_k2(lp, lr), 0.5 * (lp - lr) ** 2, rtol=1e-6)
  np.testing.assert_allclose(rl.kl_k3(lp, lr), np.exp(lr - lp) - (lr - lp) - 1, rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(rl.kl_k3(lp, lr)) >= 0)
  wide = np.linspace(-5, 5, 101, dtype=np.float32)
  assert np.all(np.asarray(rl.kl_k3(wide, 0 * wide)) >= 0)
  # k3 is unbiased: sampled from p, its mean is KL(p || q)
  p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.2, 0.6])
  ks = np.asarray(rl.kl_k3(np.log(p).astype(np.float32), np.log(q).astype(np.float32)))
  np.testing.assert_allclose((p * ks).sum(), (p * np.log(p / q)).sum(), rtol=1e-5)


def np_ppo(logp, logp_old, adv, mask, eps, eps_high):
  """Loss sum and d loss / d logp per token, written out case by case."""
  ratio = np.exp(logp - logp_old)
  clipped = np.clip(ratio, 1 - eps, 1 + eps_high)
  loss = -np.minimum(ratio * adv, clipped * adv)
  # the unclipped term is active (gradient -ratio * adv) unless the clip binds: ratio outside the range on
  # the side where the advantage would push it further
  binds = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps))
  grad = np.where(binds, 0.0, -ratio * adv) * mask
  return (loss * mask).sum(), grad, (binds * mask).sum()


@pytest.mark.parametrize("eps_high", [None, 0.3])
def test_ppo_policy_loss_and_gradient(inputs, eps_high):
  logp_old, mask, adv = inputs["logp_old"], inputs["mask"], inputs["adv"]
  logp = logp_old + np.random.default_rng(1).normal(size=(B, T)).astype(np.float32) * 0.4
  eps = 0.2
  want_loss, want_grad, want_clipped = np_ppo(logp, logp_old, adv, mask, eps, eps if eps_high is None else eps_high)
  assert 0 < want_clipped < mask.sum()  # the inputs exercise both cases
  loss_fn = lambda lp: rl.ppo_policy_loss(lp, logp_old, adv, mask, eps, eps_high)
  (loss, sums), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  assert sums["count"] == mask.sum() and sums["clip_fraction"] == want_clipped
  ratio = np.exp(logp - logp_old)
  np.testing.assert_allclose(sums["approx_kl"], (((ratio - 1) - np.log(ratio)) * mask).sum(), rtol=1e-4)


def test_ppo_policy_loss_at_old_policy_is_minus_advantage(inputs):
  """ratio 1: the loss is -sum(A), nothing clipped, approx KL 0, gradient -A."""
  logp_old, mask, adv = inputs["logp_old"], inputs["mask"], inputs["adv"]
  (loss, sums), grad = jax.value_and_grad(lambda lp: rl.ppo_policy_loss(lp, logp_old, adv, mask, 0.2),
                                          has_aux=True)(jnp.asarray(logp_old))
  np.testing.assert_allclose(loss, -(adv * mask).sum(), rtol=1e-5)
  np.testing.assert_allclose(grad, -adv * mask, rtol=1e-6)
  assert sums["clip_fraction"] == 0 and sums["approx_kl"] == 0


@pytest.mark.parametrize("value_clip", [0.0, 0.1])
def test_ppo_value_loss_and_gradient(inputs, value_clip):
  rng = np.random.default_rng(2)
  v_old = rng.normal(size=(B, T)).astype(np.float32)
  v = v_old + rng.normal(size=(B, T)).astype(np.float32) * 0.3
  ret = rng.normal(size=(B, T)).astype(np.float32)
  mask = inputs["mask"]
  a = (v - ret) ** 2
  vc = v_old + np.clip(v - v_old, -value_clip, value_clip) if value_clip else v
  b = (vc - ret) ** 2
  want = (0.5 * np.maximum(a, b) * mask).sum()
  # clipped branch active: no gradient through V (the clip is saturated) unless inside the clip range
  inside = np.abs(v - v_old) < value_clip if value_clip else np.ones_like(v, bool)
  want_grad = np.where(b > a, np.where(inside, vc - ret, 0.0), v - ret) * mask
  (loss, sums), grad = jax.value_and_grad(lambda x: rl.ppo_value_loss(x, v_old, ret, mask, value_clip),
                                          has_aux=True)(jnp.asarray(v))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  assert sums["value_clip_fraction"] == ((b > a) * mask).sum()
  if value_clip:
    assert 0 < sums["value_clip_fraction"]


def np_gae(rewards, values, mask, gamma, lam):
  """Per row, over its real tokens only, a plain backward loop; the value after the last is 0."""
  adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
    running, next_value = 0.0, 0.0
    for t in reversed(idx):
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      running = delta + gamma * lam * running
      adv[b, t], ret[b, t] = running, running + values[b, t]
      next_value = values[b, t]
  return adv, ret


@pytest.mark.parametrize("t, gamma, lam, holes", [(1, 1.0, 0.95, False), (6, 0.99, 0.95, False),
                                                  (13, 1.0, 1.0, False), (9, 0.9, 0.5, True)])
def test_gae_equals_loop(t, gamma, lam, holes):
  rng = np.random.default_rng(t)
  b = 5
  rewards, values = rng.normal(size=(b, t)).astype(np.float32), rng.normal(size=(b, t)).astype(np.float32)
  lengths = rng.integers(0, t + 1, b)
  lengths[0] = t
  mask = (np.arange(t) < lengths[:, None]).astype(np.float32)
  if holes:  # masked tokens inside a response are skipped
    mask *= rng.random((b, t)) > 0.3
  want_adv, want_ret = np_gae(rewards, values, mask, gamma, lam)
  adv, ret = jax.jit(rl.gae, static_argnums=(3, 4))(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)


def test_kl_penalized_rewards(inputs):
  logp, logp_ref, mask = inputs["logp_old"], inputs["logp_ref"], inputs["mask"]
  score = np.array([1.0, -2.0, 0.5], np.float32)
  want = -0.1 * (logp - logp_ref) * mask
  for b, last in enumerate([4, 2, 0]):
    want[b, last] += score[b]
  np.testing.assert_allclose(rl.kl_penalized_rewards(score, logp, logp_ref, mask, 0.1), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_advantages(scale):
  r = np.random.default_rng(3).normal(size=(4, 6)).astype(np.float32)
  r[1] = 1.0  # a group whose samples all agree: advantage 0, not NaN
  want = r - r.mean(1, keepdims=True)
  if scale == "std":
    want = want / (r.std(1, keepdims=True) + 1e-6)
  got = rl.group_advantages(r, scale)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got)[1] == 0)


@pytest.mark.parametrize("how", ["token", "sequence"])
def test_grpo_loss_and_gradient(inputs, how):
  logp_old, logp_ref, mask = inputs["logp_old"], inputs["logp_ref"], inputs["mask"]
  logp = logp_old + np.random.default_rng(4).normal(size=(B, T)).astype(np.float32) * 0.4
  adv_B = np.array([1.2, -0.7, 0.4], np.float32)
  eps, beta = 0.2, 0.05
  adv = np.broadcast_to(adv_B[:, None], (B, T))
  _, pg_grad, _ = np_ppo(logp, logp_old, adv, mask, eps, eps)
  ratio = np.exp(logp - logp_old)
  pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
  k3 = np.exp(logp_ref - logp) - (logp_ref - logp) - 1
  per_token = pg + beta * k3
  grad_token = pg_grad + beta * (1 - np.exp(logp_ref - logp)) * mask
  if how == "token":  # one sum over all tokens; the step divides by the token count
    weights, count = mask, mask.sum()
  else:  # each sequence's mean; the step divides by the sequence count
    weights, count = mask / mask.sum(1, keepdims=True), B
  want = (per_token * weights).sum()
  want_grad = grad_token * np.divide(weights, mask, out=np.zeros_like(mask), where=mask > 0)
  ent = np.abs(np.random.default_rng(5).normal(size=(B, T))).astype(np.float32)
  fn = lambda lp: rl.grpo_loss(lp, logp_old, logp_ref, adv_B, mask, eps, beta, how=how, entropy_BT=ent)
  (loss, sums), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  assert sums["count"] == count
  np.testing.assert_allclose(sums["kl"], (k3 * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(sums["entropy"], (ent * weights).sum(), rtol=1e-5)
  binds = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))
  np.testing.assert_allclose(sums["clip_fraction"], (binds * weights).sum(), rtol=1e-6)
  assert 0 < sums["clip_fraction"]


def test_grpo_without_kl_ignores_reference(inputs):
  logp_old, mask = inputs["logp_old"], inputs["mask"]
  adv_B = np.array([1.0, -1.0, 0.5], np.float32)
  a = rl.grpo_loss(logp_old, logp_old, inputs["logp_ref"], adv_B, mask, 0.2, 0.0)[0]
  b = rl.grpo_loss(logp_old, logp_old, inputs["logp_ref"] + 3.0, adv_B, mask, 0.2, 0.0)[0]
  assert a == b
  np.testing.assert_allclose(a, -(adv_B[:, None] * mask).sum(), rtol=1e-6)
