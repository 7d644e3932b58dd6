"""Direct preference optimization on [B, 2, L] pairs (posttrain/data.py): the policy's and a frozen
reference's summed log-probabilities of the chosen and rejected completion tokens, computed in the
same step (the reference under stop_gradient). The reference lives in the task state, boxed with the
policy's logical names, so it is sharded like the policy (never replicated) and checkpointed with
the run; it is the `checkpoint.init_from` params (or the same random init without one).
posttrain.loss: dpo, ipo, or simpo (reference-free: no reference is kept or run)."""

import jax
import jax.numpy as jnp

from jaxtrain.posttrain import preference
from jaxtrain.posttrain.sft import DataTask


def completion_logps(model, params, batch):
  """(summed log-prob of the completion tokens [B, 2], completion token counts [B, 2], the
  log-softmax [2B, L-1, V]) of a pair batch."""
  tokens_BTL = batch["tokens"]
  b, two, length = tokens_BTL.shape
  flat = lambda x: x.reshape(b * two, length)
  tokens_NL, mask_NL = flat(tokens_BTL), flat(batch["completion_mask"])
  logits_NLV = model.apply({"params": params}, tokens_NL[:, :-1], flat(batch["positions"])[:, :-1],
                           flat(batch["segment_ids"])[:, :-1])
  logp_NLV = jax.nn.log_softmax(logits_NLV)
  logp_NL = jnp.take_along_axis(logp_NLV, tokens_NL[:, 1:, None], axis=-1)[..., 0]
  mask_NL = mask_NL[:, 1:]
  return (jnp.sum(logp_NL * mask_NL,
                  axis=-1).reshape(b, two), jnp.sum(mask_NL, axis=-1).reshape(b, two), logp_NLV)


def token_kl(policy_NLV, ref_NLV, batch):
  """KL(policy || reference) of the next-token distributions at the completion positions, summed
  over each sequence's completion tokens, [B, 2] (exact over the vocabulary, on the data's
  contexts)."""
  b, two, _ = batch["tokens"].shape
  kl_NL = jnp.sum(jnp.exp(policy_NLV) * (policy_NLV - ref_NLV), axis=-1)
  mask_NL = batch["completion_mask"].reshape(b * two, -1)[:, 1:]
  return jnp.sum(kl_NL * mask_NL, axis=-1).reshape(b, two)


class Dpo(DataTask):
  """train.task = "dpo"."""
  pairs = True

  def __init__(self, cfg, workdir: str):
    super().__init__(cfg, workdir)
    self.p = cfg.posttrain
    self.reference_free = self.p.loss == "simpo"

  def init(self, rng):
    params, extra, _ = super().init(rng)
    if extra:
      raise ValueError("train.task='dpo' runs dense decoders (model.n_experts=0) for now")
    return params, extra, {} if self.reference_free else {"reference": params}

  def init_from(self, params, task_state, load):
    """Policy and reference both start from the checkpoint (two reads: two sets of buffers)."""
    return load(params), ({}
                          if self.reference_free else {"reference": load(task_state["reference"])})

  def loss(self, params, batch, extra, task_state):
    p = self.p
    policy_BT, lengths_BT, policy_NLV = completion_logps(self.model, params, batch)
    valid_B = batch["valid"]
    if self.reference_free:
      ref_BT = kl_BT = jnp.zeros_like(policy_BT)
      per_pair = preference.simpo(policy_BT[:, 0], policy_BT[:, 1],
                                  jnp.maximum(lengths_BT[:, 0], 1.0),
                                  jnp.maximum(lengths_BT[:, 1], 1.0), p.beta, p.simpo_gamma,
                                  p.label_smoothing)
    else:
      ref_BT, _, ref_NLV = jax.lax.stop_gradient(
          completion_logps(self.model, task_state["reference"], batch))
      kl_BT = token_kl(jax.lax.stop_gradient(policy_NLV), ref_NLV, batch)
      args = (policy_BT[:, 0], policy_BT[:, 1], ref_BT[:, 0], ref_BT[:, 1], p.beta)
      per_pair = (preference.ipo(*args) if p.loss == "ipo"
                  else preference.dpo(*args, p.label_smoothing))
    reward_BT = p.beta * (policy_BT - ref_BT)  # the implicit rewards
    margin_B = reward_BT[:, 0] - reward_BT[:, 1]
    loss = jnp.sum(per_pair * valid_B)
    pair_sum = lambda x_B: jnp.sum(x_B * valid_B)
    return loss, {"loss": loss, "reward_margin": pair_sum(margin_B),
                  "accuracy": pair_sum(margin_B > 0), "chosen_reward": pair_sum(reward_BT[:, 0]),
                  "rejected_reward": pair_sum(reward_BT[:, 1]),
                  # per sequence (mean of chosen and rejected), summed over its completion
                  # tokens; 0 for simpo
                  "kl": pair_sum(jnp.mean(kl_BT, axis=-1)), "count": jnp.sum(valid_B)}
