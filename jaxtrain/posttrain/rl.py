"""The math of RL post-training (PPO, GRPO), as pure jnp functions on response tokens.

Shapes: _BT [batch, response tokens], _BTV with the vocabulary, _B one per sequence, _BG [prompts,
group]. `mask_BT` is 1.0 on real response tokens and 0.0 on padding (after a stop token, or a
left-out token).

Losses follow the loop's convention (core/task.py, core/step.py): they return
`(objective, sums)` where the objective is SUMMED over units and `sums` holds metric sums over the
same units and "count", the number of units; the step divides gradients and metrics by the count.
`aggregate` picks the unit:
  "token":    a unit is a response token: sum over all tokens / all tokens of the batch (DAPO, Yu et
              al., 2025), so long responses weigh by their length;
  "sequence": a unit is a sequence: each sequence's token mean, summed, / sequences (GRPO as in
              DeepSeekMath, Shao et al., 2024).
"""

import jax
import jax.numpy as jnp

AGGREGATES = ("token", "sequence")


def token_logprobs(logits_BTV, targets_BT):
  """log softmax(logits)[target] per token, float32 [B, T]
  (the logits of position t predict target t)."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None].astype(jnp.int32),
                                  axis=-1)[..., 0]
  return picked_BT - jax.nn.logsumexp(logits_BTV, axis=-1)


def sampled_logprobs(logits_BTV, targets_BT, top_k: int = 0):
  """log-probs of the targets under the distribution a top-k sampler draws from: softmax of the
  logits renormalized over the top_k largest (0: the whole vocabulary, `token_logprobs`), float32
  [B, T]. A target outside the top k (possible once the params moved away from those that sampled
  it) keeps its own logit over the same normalizer: finite, and smaller than any kept token's."""
  if top_k <= 0:
    return token_logprobs(logits_BTV, targets_BT)
  logits_BTV = logits_BTV.astype(jnp.float32)
  kth_BT1 = jax.lax.top_k(logits_BTV, top_k)[0][..., -1:]
  kept_BTV = jnp.where(logits_BTV < jax.lax.stop_gradient(kth_BT1), -jnp.inf, logits_BTV)
  picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None].astype(jnp.int32),
                                  axis=-1)[..., 0]
  return picked_BT - jax.nn.logsumexp(kept_BTV, axis=-1)


def entropy(logits_BTV):
  """Entropy of softmax(logits) per token, float32 [B, T]."""
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)


def kl_k1(logp_BT, logp_ref_BT):
  """KL(policy || ref) estimated per sampled token: logp - logp_ref (unbiased, can be negative)."""
  return logp_BT - logp_ref_BT


def kl_k2(logp_BT, logp_ref_BT):
  """0.5 (logp - logp_ref)^2: biased, low variance, >= 0
  (Schulman, "Approximating KL divergence", 2020)."""
  return 0.5 * jnp.square(logp_BT - logp_ref_BT)


def kl_k3(logp_BT, logp_ref_BT):
  """exp(r) - r - 1 with r = logp_ref - logp: unbiased for KL(policy || ref) and >= 0
  (Schulman, 2020)."""
  r_BT = logp_ref_BT - logp_BT
  return jnp.exp(r_BT) - r_BT - 1.0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def gae(rewards_BT, values_BT, mask_BT, gamma: float, lam: float):
  """Generalized advantage estimation (Schulman et al., 2016): (advantages_BT, returns_BT), 0 where
  masked.

  delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns = A + V, by a
  backward lax.scan over T. Masked tokens are skipped (the next real token follows directly), and
  the value after a sequence's last real token is 0 (the episode ends): rows of any length share one
  [B, T] array."""
  rewards_TB, values_TB, mask_TB = (jnp.asarray(x, jnp.float32).T
                                    for x in (rewards_BT, values_BT, mask_BT))

  def step(carry, xs):
    next_value_B, next_adv_B = carry
    r_B, v_B, m_B = xs
    adv_B = r_B + gamma * next_value_B - v_B + gamma * lam * next_adv_B
    keep_B = m_B > 0
    carry = (jnp.where(keep_B, v_B, next_value_B), jnp.where(keep_B, adv_B, next_adv_B))
    return carry, jnp.where(keep_B, adv_B, 0.0)

  zeros_B = jnp.zeros(rewards_TB.shape[1], jnp.float32)
  _, adv_TB = jax.lax.scan(step, (zeros_B, zeros_B), (rewards_TB, values_TB, mask_TB), reverse=True)
  adv_BT = adv_TB.T
  return adv_BT, (adv_BT + values_TB.T) * (mask_TB.T > 0)


def last_token_index(mask_BT):
  """Index of each row's last real token [B]; -1 for a row with none."""
  t_BT = jnp.broadcast_to(jnp.arange(mask_BT.shape[1]), mask_BT.shape)
  return jnp.max(jnp.where(mask_BT > 0, t_BT, -1), axis=1)


def kl_penalized_rewards(score_B, logp_BT, logp_ref_BT, mask_BT, kl_coef: float,
                         estimator: str = "k1"):
  """Per-token PPO-RLHF rewards (Ouyang et al., 2022): -kl_coef * KL estimate on every real token,
  plus the sequence's score (reward model or reward function) on its last real token. [B, T], 0
  where masked. The logps are the sampling policy's (logp_old) and the reference's, so no gradient
  flows through them."""
  kl_BT = KL_ESTIMATORS[estimator](logp_BT, logp_ref_BT)
  last_BT = jnp.arange(mask_BT.shape[1]) == last_token_index(mask_BT)[:, None]
  rewards_BT = -kl_coef * kl_BT + jnp.where(last_BT, score_B[:, None], 0.0)
  return jax.lax.stop_gradient(rewards_BT * (mask_BT > 0))


def aggregate(x_BT, mask_BT, how: str):
  """Sum of `x` over units and the unit count (see the module docstring): (sum, count)."""
  mask_BT = mask_BT.astype(jnp.float32)
  if how == "token":
    return jnp.sum(x_BT * mask_BT), jnp.sum(mask_BT)
  if how == "sequence":
    tokens_B = jnp.sum(mask_BT, axis=1)
    per_seq_B = jnp.sum(x_BT * mask_BT, axis=1) / jnp.maximum(tokens_B, 1.0)
    return jnp.sum(per_seq_B), jnp.sum(tokens_B > 0).astype(jnp.float32)
  raise ValueError(f"aggregate: {how!r} is not one of {AGGREGATES}")


def clipped_surrogate(logp_BT, logp_old_BT, advantages_BT, clip_eps: float,
                      clip_eps_high: float | None = None):
  """PPO's clipped surrogate loss per token, -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A)
  with ratio = exp(logp - logp_old) (Schulman et al., 2017; eps_high > eps is DAPO's clip-higher,
  None: eps), and whether the clipped term binds (its gradient is zero there): (loss_BT, clipped_BT
  float 0/1)."""
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  ratio_BT = jnp.exp(logp_BT - logp_old_BT)
  unclipped_BT = ratio_BT * advantages_BT
  clipped_BT = jnp.clip(ratio_BT, 1.0 - clip_eps, 1.0 + eps_high) * advantages_BT
  return -jnp.minimum(unclipped_BT, clipped_BT), (clipped_BT < unclipped_BT).astype(jnp.float32)


def _ratio_sum(logp_BT, logp_old_BT, mask_BT, how: str):
  """The importance ratio exp(logp - logp_old) summed over units (no gradient): 1 per unit at the
  sampling params, moving away from 1 as a rollout batch is reused (posttrain.ppo_epochs)."""
  return aggregate(jax.lax.stop_gradient(jnp.exp(logp_BT - logp_old_BT)), mask_BT, how)[0]


def ppo_policy_loss(logp_BT, logp_old_BT, advantages_BT, mask_BT, clip_eps: float,
                    clip_eps_high: float | None = None, how: str = "token"):
  """PPO policy loss: (objective summed over units, sums) with sums "policy_loss", "clip_fraction"
  (tokens where the clip binds), "ratio_mean", "approx_kl" (KL(old || new) by k3 on the old
  policy's samples: ratio - 1 - log ratio) and "count". The KL penalty to the reference goes into
  the rewards (`kl_penalized_rewards`), as in InstructGPT; for KL as a loss term, add `beta *
  aggregate(kl_k3(logp, logp_ref), mask, how)[0]` to the objective."""
  loss_BT, clipped_BT = clipped_surrogate(logp_BT, logp_old_BT, advantages_BT, clip_eps,
                                          clip_eps_high)
  loss, count = aggregate(loss_BT, mask_BT, how)
  sums = {"policy_loss": loss, "clip_fraction": aggregate(clipped_BT, mask_BT, how)[0],
          "ratio_mean": _ratio_sum(logp_BT, logp_old_BT, mask_BT, how),
          "approx_kl": aggregate(jax.lax.stop_gradient(kl_k3(logp_old_BT, logp_BT)), mask_BT,
                                 how)[0],
          "count": count}
  return loss, sums


def ppo_value_loss(values_BT, values_old_BT, returns_BT, mask_BT, value_clip: float,
                   how: str = "token"):
  """Clipped value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2)
  (value_clip 0: no clipping): (objective summed over units, sums "value_loss",
  "value_clip_fraction", "count")."""
  sq_BT = jnp.square(values_BT - returns_BT)
  if value_clip > 0:
    v_clipped_BT = values_old_BT + jnp.clip(values_BT - values_old_BT, -value_clip, value_clip)
    sq_clipped_BT = jnp.square(v_clipped_BT - returns_BT)
  else:
    sq_clipped_BT = sq_BT
  loss_BT = 0.5 * jnp.maximum(sq_BT, sq_clipped_BT)
  loss, count = aggregate(loss_BT, mask_BT, how)
  clipped_BT = (sq_clipped_BT > sq_BT).astype(jnp.float32)
  return loss, {"value_loss": loss, "value_clip_fraction": aggregate(clipped_BT, mask_BT, how)[0],
                "count": count}


def group_advantages(rewards_BG, scale: str = "std", eps: float = 1e-6):
  """GRPO advantages per sample, [B, G]: (reward - group mean) / (group std + eps) with
  `scale="std"` (population std), or reward - group mean with `scale="none"` (Dr. GRPO, Liu et al.,
  2025)."""
  rewards_BG = jnp.asarray(rewards_BG, jnp.float32)
  centered_BG = rewards_BG - jnp.mean(rewards_BG, axis=1, keepdims=True)
  if scale == "none":
    return centered_BG
  if scale == "std":
    return centered_BG / (jnp.std(rewards_BG, axis=1, keepdims=True) + eps)
  raise ValueError(f"group_advantages: scale {scale!r} is not 'std' or 'none'")


def grpo_loss(logp_BT, logp_old_BT, logp_ref_BT, advantages_B, mask_BT, clip_eps: float,
              beta: float, clip_eps_high: float | None = None, how: str = "token", entropy_BT=None):
  """GRPO (Shao et al., 2024): per token the clipped surrogate with the sequence's advantage, plus
  beta * k3(policy || ref); aggregated by `how` (module docstring). Rows are samples ([prompts * G];
  their advantages from `group_advantages(...).reshape(-1)`); `logp_ref_BT` is ignored when beta ==
  0. Returns (objective summed over units, sums): "loss", "policy_loss", "kl" (k3), "clip_fraction",
  "ratio_mean", "entropy" when `entropy_BT` is given, and "count"."""
  loss_BT, clipped_BT = clipped_surrogate(logp_BT, logp_old_BT, advantages_B[:, None], clip_eps,
                                          clip_eps_high)
  policy_loss, count = aggregate(loss_BT, mask_BT, how)
  kl_BT = kl_k3(logp_BT, logp_ref_BT) if beta else jnp.zeros_like(logp_BT)
  kl = aggregate(kl_BT, mask_BT, how)[0]
  loss = policy_loss + beta * kl
  sums = {"loss": loss, "policy_loss": policy_loss, "kl": jax.lax.stop_gradient(kl),
          "clip_fraction": aggregate(clipped_BT, mask_BT, how)[0],
          "ratio_mean": _ratio_sum(logp_BT, logp_old_BT, mask_BT, how), "count": count}
  if entropy_BT is not None:
    sums["entropy"] = aggregate(jax.lax.stop_gradient(entropy_BT), mask_BT, how)[0]
  return loss, sums
