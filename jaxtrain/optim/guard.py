"""Skipping non-finite updates, counted in the optimizer state."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class SkipState(NamedTuple):
  inner_state: optax.OptState
  # int32: skipped updates in a row (the loop stops or rolls back on it)
  consecutive_skips: jax.Array
  # int32: every skipped update of the run (`skipped_steps` in the metrics)
  total_notfinite: jax.Array


def _finite(tree) -> jax.Array:
  return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner`, except that a step whose gradient, or whose resulting update, is not finite changes
  nothing (zero update, inner state kept) and is counted. Unlike optax.apply_if_finite it also
  catches updates that turn non-finite inside `inner` (a NaN learning rate, an overflowing second
  moment), and it never gives up: what to do after many skips in a row is the loop's decision
  (optim.on_divergence)."""

  def init(params):
    zero = jnp.zeros([], jnp.int32)
    return SkipState(inner.init(params), zero, zero)

  def update(updates, state, params=None):
    def apply(_):
      new_updates, new_inner = inner.update(updates, state.inner_state, params)
      ok = _finite(new_updates)
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      return (keep(new_updates, optax.tree.zeros_like(new_updates)),
              keep(new_inner, state.inner_state), ok)

    finite = _finite(updates)

    # `finite` (False here) rather than a constant: it varies like the gradient in a shard_map
    def reject(_):
      return optax.tree.zeros_like(updates), state.inner_state, finite

    updates, inner_state, ok = jax.lax.cond(finite, apply, reject, None)
    skipped = jnp.logical_not(ok).astype(jnp.int32)
    return updates, SkipState(inner_state, (state.consecutive_skips + skipped) * skipped,
                              state.total_notfinite + skipped)

  return optax.GradientTransformation(init, update)
