"""PPO on the loop (train.task="ppo"): the rollouts, rewards and reference of GRPO
(posttrain/grpo.py), with a value head, GAE and the KL penalty in the rewards (InstructGPT, Ouyang
et al., 2022).

The value head is a scalar head like the reward model's (posttrain/reward.py) on the policy's final
hidden states, trained jointly: params = {decoder..., "value_head": {"w": [D], "b": []}}. In
`make_batch`, after the rewards: the values of the sampling params at each response token (V_old),
per-token rewards = -kl_coef * k1(logp_old, logp_ref) with the sequence's reward added on its last
token (rl.kl_penalized_rewards), then rl.gae -> advantages (whitened over the batch's response
tokens) and returns, all over the whole rollout batch. The loss: rl.ppo_policy_loss + value_coef *
rl.ppo_value_loss (clipped around V_old by posttrain.value_clip), one optimizer step per rollout
batch, or posttrain.ppo_epochs passes of posttrain.minibatches shuffled minibatches over it
(posttrain/reuse.py), where the ratio and the values move away from the sampler's and the clips
bind.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.model import axes
from jaxtrain.posttrain import rl
from jaxtrain.posttrain.grpo import RlTask

HEAD = "value_head"


def whiten(x_NT, mask_NT, eps: float = 1e-8):
  """(x - mean) / std over the masked entries (0 elsewhere)."""
  n = jnp.maximum(jnp.sum(mask_NT), 1.0)
  mean = jnp.sum(x_NT * mask_NT) / n
  var = jnp.sum(jnp.square(x_NT - mean) * mask_NT) / n
  return (x_NT - mean) * jax.lax.rsqrt(var + eps) * mask_NT


class Ppo(RlTask):
  """train.task = "ppo"."""

  def init(self, rng):
    params, extra, task_state = super().init(jax.random.fold_in(rng, 0))
    d = self.model.cfg.d_model
    w = nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                     (axes.EMBED,))(jax.random.fold_in(rng, 1), (d,), jnp.float32)
    return {**params, HEAD: {"w": w, "b": jnp.zeros((), jnp.float32)}}, extra, task_state

  def init_from(self, params, task_state, load):
    """The decoder (and the reference) from the checkpoint, the value head fresh."""
    decoder, reference = load(self.decoder(params)), task_state
    if task_state:
      reference = {"reference": load(task_state["reference"])}
    return {**decoder, HEAD: params[HEAD]}, reference

  def decoder(self, params):
    return {k: v for k, v in params.items() if k != HEAD}

  def policy(self, params, batch):
    """(logits [N, T, V], values [N, T]) at the response tokens, one forward."""
    logits_NTV, hidden_NTD = self.response_logits(self.decoder(params), batch, return_hidden=True)
    head = params[HEAD]
    values_NT = hidden_NTD.astype(jnp.float32) @ head["w"].astype(jnp.float32) + head["b"]
    return logits_NTV, values_NT * batch["mask"]

  def advantages(self, params, arrays, reward_N):
    p, mask_NT = self.p, arrays["mask"]
    values_NT = jax.lax.stop_gradient(self.policy(params, arrays)[1])
    rewards_NT = rl.kl_penalized_rewards(reward_N, arrays["logp_old"], arrays["logp_ref"], mask_NT,
                                         p.kl_coef)
    adv_NT, returns_NT = rl.gae(rewards_NT, values_NT, mask_NT, p.gamma, p.lam)
    return {"advantages": whiten(adv_NT, mask_NT), "returns": returns_NT, "values_old": values_NT}

  def loss(self, params, batch, extra, task_state):
    del extra, task_state
    p, mask_NT = self.p, batch["mask"]
    logits_NTV, values_NT = self.policy(params, batch)
    logp_NT = self.token_logps(logits_NTV, batch)
    policy_loss, sums = rl.ppo_policy_loss(logp_NT, batch["logp_old"], batch["advantages"], mask_NT,
                                           p.clip_eps, how=p.aggregate)
    value_loss, value_sums = rl.ppo_value_loss(values_NT, batch["values_old"], batch["returns"],
                                               mask_NT, p.value_clip, how=p.aggregate)
    objective = policy_loss + p.value_coef * value_loss
    stop = jax.lax.stop_gradient
    sums.update(
        loss=objective, value_loss=value_sums["value_loss"],
        value_clip_fraction=value_sums["value_clip_fraction"],
        kl=rl.aggregate(stop(rl.kl_k3(logp_NT, batch["logp_ref"])), mask_NT, p.aggregate)[0],
        entropy=rl.aggregate(stop(rl.entropy(self.scaled(logits_NTV))), mask_NT, p.aggregate)[0])
    return objective, {**sums, **self.host_sums(batch)}
