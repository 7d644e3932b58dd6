"""Explicit gradient reductions, performed by the optimizer chain.

With `optim.reduce_axis` set, the train step runs manual over that data axis (jax.shard_map) and
computes each shard's gradient of its own rows; the first transformation of the chain reduces them.
This is the seam for communication-efficient reductions: a compressed one replaces `sum_over`."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain import collectives


class ReduceState(NamedTuple):
  grad_norm: jax.Array  # global norm of the reduced gradient (the step reports it as `grad_norm`)


def sum_over(axis: str) -> optax.GradientTransformation:
  """Sums each shard's gradient over mesh axis `axis` with a full-width all-reduce (psum)."""

  def init(params):
    del params
    return ReduceState(jnp.zeros([], jnp.float32))

  def update(updates, state, params=None):
    del state, params
    reduced = collectives.psum(updates, (axis,))
    return reduced, ReduceState(optax.tree.norm(reduced))

  return optax.GradientTransformation(init, update)
