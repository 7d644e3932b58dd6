"""The pure train step, built around a loss passed in: gradient accumulation, one optimizer step.

A loss is `loss_fn(params, batch, extra, task_state) -> (objective, sums)`: `objective` is a *sum*
over the units of the batch (tokens, pairs, sequences) and `sums` a dict of sums whose "count" says
how many units there were, so microbatches and data shards add up exactly; the gradient is divided
by the total count. Everything task-specific (what the loss is, its metrics, updates of
non-trainable state) comes from the task (jaxtrain/core/task.py); nothing here knows about language
models or experts.
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxtrain import collectives
from jaxtrain.core.state import TrainState


def split_microbatches(batch, k: int):
  """[B, ...] -> [k, B/k, ...] taking every k-th row, so each microbatch keeps the batch's
  sharding."""
  def split(x):
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def accumulate_gradients(loss_fn, state: TrainState, batch, microbatches: int):
  """Gradient of the summed objective and the loss's sums, added over microbatches with lax.scan
  (k=1: one pass). Not yet divided by the count."""
  grad_fn = jax.grad(loss_fn, has_aux=True)
  args = (state.extra, state.task_state)
  if microbatches == 1:
    return grad_fn(state.params, batch, *args)

  def body(carry, micro):
    g, sums = grad_fn(state.params, micro, *args)
    return jax.tree.map(jnp.add, carry, (g, sums)), None

  micro = split_microbatches(batch, microbatches)
  shapes = jax.eval_shape(lambda p, b: grad_fn(p, b, *args), state.params,
                          jax.tree.map(lambda x: x[0], micro))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  # inside a shard_map the per-shard sums vary over the manual axes: so must the scan's carry
  return jax.lax.scan(body, collectives.vary(zeros, collectives.manual_axes()), micro)[0]


def read_counter(opt_state, name: str):
  """An optimizer-state field found by name anywhere in the (possibly wrapped) chain; 0 if absent.
  Inside DiLoCo it is this replica's own entry (a leading axis of one)."""
  return jnp.max(optax.tree_utils.tree_get(opt_state, name, jnp.zeros((), jnp.int32)))


def make_train_step(loss_fn, tx: optax.GradientTransformation, schedule, *, metrics_fn,
                    update_extra=None, microbatches: int = 1, reduce_axis: str = "",
                    state_specs=P(), local_metrics: bool = False, loss_params=None):
  """`train_step(state, batch) -> (state, metrics)`, pure; the loop jits it once.

  `metrics_fn(sums, parts)` and `update_extra(extra, sums, parts)` (non-trainable state moved
  outside the optimizer) receive the sums over the whole batch, with "count" at least 1, and the
  number of parts they were added from (microbatches x data shards), to turn summed means back into
  means. With `reduce_axis`, the step runs manual over that mesh axis: each shard differentiates its
  own rows and `tx` (whose first transformation reduces over the axis) sees the shards' gradients;
  `state_specs` (a prefix of the state) lays per-shard leaves of the state on the axis (their
  leading dimension). `loss_params(opt_state)` says where the loss is taken when not at the global
  params (DiLoCo: each shard's own copy; optim.outer gives all three of axis, local_metrics,
  loss_params), and with `local_metrics` nothing is reduced over the axis: each metric comes back
  per shard, with a leading axis of one entry per shard (the loop averages them on the host)."""
  shards = lambda: collectives.axis_size(reduce_axis) if reduce_axis else 1

  def train_step(state: TrainState, batch):
    # Per-shard gradients: params marked varying over the axis, else shard_map's autodiff would sum
    # the gradient of these replicated params over it by itself (a full-width psum no transformation
    # sees).
    axes = (reduce_axis,) if reduce_axis else ()
    at = (collectives.vary(state.params, axes) if loss_params is None
          else loss_params(state.opt_state))
    grads, sums = accumulate_gradients(loss_fn, state.replace(params=at), batch, microbatches)
    sums = sums if local_metrics else collectives.psum(sums, axes)
    sums["count"] = jnp.maximum(sums["count"], 1.0)
    grads = jax.tree.map(lambda g: g / sums["count"], grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    parts = microbatches * (1 if local_metrics else shards())
    extra = state.extra if update_extra is None else update_extra(state.extra, sums, parts)
    # set by an explicit reduction
    grad_norm = optax.tree_utils.tree_get(opt_state, "grad_norm", None)
    metrics = {
        **metrics_fn(sums, parts),
        "grad_norm": optax.tree.norm(grads) if grad_norm is None else grad_norm,
        "param_norm": optax.tree.norm(params),
        "update_norm": optax.tree.norm(updates),
        "lr": schedule(state.step),
        "skipped_steps": read_counter(opt_state, "total_notfinite"),
        "consecutive_skips": read_counter(opt_state, "consecutive_skips"),
    }
    if local_metrics:  # one entry per shard, laid on the axis
      metrics = jax.tree.map(lambda m: m[None], metrics)
    state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, extra=extra)
    return state, metrics

  if not reduce_axis:
    return train_step
  metrics_spec = P(reduce_axis) if local_metrics else P()
  return lambda state, batch: collectives.shard_map(
      train_step, (reduce_axis,), in_specs=(state_specs, P(reduce_axis)),
      out_specs=(state_specs, metrics_spec))(state, batch)
