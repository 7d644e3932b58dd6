"""Pure step functions: loss, gradient accumulation, one optimizer step, evaluation."""

import jax
import jax.numpy as jnp
import optax

from jaxtrain.train.state import TrainState


def cross_entropy(logits_BLV, targets_BL, mask_BL, z_loss: float):
  """Sums over tokens (not means, so microbatches add up exactly): (ce, z, tokens)."""
  lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  ce = jnp.sum((lse_BL - target_logit_BL) * mask_BL)
  z = z_loss * jnp.sum(jnp.square(lse_BL) * mask_BL)
  return ce, z, jnp.sum(mask_BL)


def loss_sums(params, model, batch, z_loss: float):
  """Summed objective (ce + z-loss) for autodiff, with the parts as aux."""
  logits_BLV = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
  ce, z, tokens = cross_entropy(logits_BLV, batch["targets"], batch["loss_mask"], z_loss)
  return ce + z, (ce, z, tokens)


def split_microbatches(batch, k: int):
  """[B, ...] -> [k, B/k, ...] taking every k-th row, so each microbatch keeps the batch's sharding."""
  def split(x):
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def accumulate_gradients(params, model, batch, microbatches: int, z_loss: float):
  """Gradient of the token-mean loss, summed over microbatches with lax.scan (k=1: one pass)."""
  grad_fn = jax.grad(loss_sums, has_aux=True)

  def body(carry, micro):
    grads, sums = carry
    g, parts = grad_fn(params, model, micro, z_loss)
    return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, parts)), None

  zeros = (jax.tree.map(jnp.zeros_like, params), (0.0, 0.0, 0.0))
  if microbatches == 1:
    (grads, sums), _ = body(zeros, batch)
  else:
    (grads, sums), _ = jax.lax.scan(body, zeros, split_microbatches(batch, microbatches))
  ce, z, tokens = sums
  tokens = jnp.maximum(tokens, 1.0)
  return jax.tree.map(lambda g: g / tokens, grads), (ce / tokens, z / tokens, tokens)


def train_step(state: TrainState, batch, *, model, tx, schedule, microbatches: int, z_loss: float):
  """One optimizer step: (state, batch) -> (state, metrics). Jitted once, by the loop."""
  grads, (loss, z, tokens) = accumulate_gradients(state.params, model, batch, microbatches, z_loss)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
      "loss": loss,
      "z_loss": z,
      "tokens": tokens,
      "grad_norm": optax.tree.norm(grads),
      "param_norm": optax.tree.norm(params),
      "update_norm": optax.tree.norm(updates),
      "lr": schedule(state.step),
      "skipped_steps": getattr(opt_state, "total_notfinite", jnp.zeros((), jnp.int32)),
  }
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch, *, model):
  """Summed cross-entropy, token count and (synthetic data) summed exact entropy of one batch."""
  _, (ce, _, tokens) = loss_sums(params, model, batch, 0.0)
  entropy = jnp.sum(batch["entropy"] * batch["loss_mask"]) if "entropy" in batch else jnp.zeros(())
  return {"ce": ce, "tokens": tokens, "entropy": entropy}
