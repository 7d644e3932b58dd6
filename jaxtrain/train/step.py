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


def loss_sums(params, model, batch, z_loss: float, extra=None):
  """Summed objective (ce + z-loss + MoE router losses) for autodiff, with the parts as aux."""
  logits_BLV, aux = model.apply({"params": params, **(extra or {})}, batch["inputs"], batch["positions"],
                                batch["segment_ids"], mutable=["moe_stats"])
  ce, z, tokens = cross_entropy(logits_BLV, batch["targets"], batch["loss_mask"], z_loss)
  moe = moe_summary(aux.get("moe_stats", {}))
  objective = ce + z
  if moe:  # router losses are token means: weighted by this batch's tokens, like the summed ce
    c = model.cfg
    objective = objective + tokens * (c.aux_loss_weight * moe["aux_loss"] + c.router_z_weight * moe["z_loss"])
  return objective, (ce, z, tokens, moe)


def moe_summary(moe_stats: dict) -> dict:
  """Per-layer MoE statistics of every scan (sown by the model) -> means over MoE layers, and the
  [moe layers, experts] load. Empty for a dense model."""
  per_layer = [stats for name in sorted(moe_stats) for stats in moe_stats[name]]
  if not per_layer:
    return {}
  joined = {k: jnp.concatenate([s[k].reshape(-1, *s[k].shape[1:]) for s in per_layer]) for k in per_layer[0]}
  out = {k: jnp.mean(v) for k, v in joined.items() if k != "load"}
  out["load"] = joined["load"]
  return out


def split_microbatches(batch, k: int):
  """[B, ...] -> [k, B/k, ...] taking every k-th row, so each microbatch keeps the batch's sharding."""
  def split(x):
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def accumulate_gradients(params, model, batch, microbatches: int, z_loss: float, extra=None):
  """Gradient of the token-mean loss, summed over microbatches with lax.scan (k=1: one pass).
  Returns (grads, (loss, z, tokens, moe)) with MoE statistics averaged over microbatches."""
  grad_fn = jax.grad(loss_sums, has_aux=True)

  def body(carry, micro):
    grads, sums = carry
    g, parts = grad_fn(params, model, micro, z_loss, extra)
    return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, parts)), None

  if microbatches == 1:
    grads, (ce, z, tokens, moe) = grad_fn(params, model, batch, z_loss, extra)
  else:
    micro = split_microbatches(batch, microbatches)
    shapes = jax.eval_shape(lambda p, b: grad_fn(p, model, b, z_loss, extra), params,
                            jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, (ce, z, tokens, moe)), _ = jax.lax.scan(body, zeros, micro)
    moe = jax.tree.map(lambda v: v / microbatches, moe)
  tokens = jnp.maximum(tokens, 1.0)
  return jax.tree.map(lambda g: g / tokens, grads), (ce / tokens, z / tokens, tokens, moe)


def update_expert_bias(extra: dict, load_NE, rate: float) -> dict:
  """Auxiliary-loss-free balancing (DeepSeek-V3): each expert's selection bias moves by `rate`
  towards balance, up when the expert got less than its share of tokens, down when more."""
  leaves, treedef = jax.tree.flatten(extra["moe_state"])
  if len(leaves) != 1 or leaves[0].shape != load_NE.shape:
    raise ValueError(f"expert biases {[x.shape for x in leaves]} do not match the load {load_NE.shape}")
  bias = leaves[0] + rate * jnp.sign(1.0 / load_NE.shape[-1] - load_NE)
  return {**extra, "moe_state": jax.tree.unflatten(treedef, [bias])}


def train_step(state: TrainState, batch, *, model, tx, schedule, microbatches: int, z_loss: float):
  """One optimizer step: (state, batch) -> (state, metrics). Jitted once, by the loop."""
  grads, (loss, z, tokens, moe) = accumulate_gradients(state.params, model, batch, microbatches, z_loss,
                                                       state.extra)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  extra = state.extra
  if moe and model.cfg.bias_update_rate > 0:
    extra = update_expert_bias(extra, moe["load"], model.cfg.bias_update_rate)
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
  if moe:
    load_NE = moe["load"]
    metrics.update({"moe_aux_loss": moe["aux_loss"], "moe_z_loss": moe["z_loss"], "moe_dropped": moe["dropped"],
                    "moe_router_entropy": moe["entropy"], "moe_load": jnp.mean(load_NE, axis=0),
                    "moe_imbalance": jnp.mean(jnp.max(load_NE, axis=-1)) * load_NE.shape[-1]})
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, extra=extra), metrics


def eval_step(params, batch, *, model, extra=None):
  """Summed cross-entropy, token count and (synthetic data) summed exact entropy of one batch."""
  _, (ce, _, tokens, _) = loss_sums(params, model, batch, 0.0, extra)
  entropy = jnp.sum(batch["entropy"] * batch["loss_mask"]) if "entropy" in batch else jnp.zeros(())
  return {"ce": ce, "tokens": tokens, "entropy": entropy}
