"""DiLoCo and Streaming DiLoCo as one optax transformation.

Each shard of the manual mesh axis (a *replica*) trains its own copy of the parameters with the
inner optimizer and no collective over the axis. Every H inner steps the replicas average their
outer gradient (global params minus their own), in any wire format of quantize.py by the same
two-collective reduction as compress.py, and an outer Nesterov-momentum SGD step moves the global
params; every replica then continues from them (Douillard et al. 2023). Streaming (Douillard et al.
2025): the flat parameter vector, ordered layer by layer, is cut into P fragments, one fragment
syncs every H/P steps (staggered, so a sync sends 1/P of the bytes), and with a delay tau its
average is applied tau inner steps after it was sent, merged with the replica's copy, so that the
collective feeds no step before tau later ones.

Layout of the state (its sharding): the inner optimizer's state and the replica's params have a
leading axis of one entry per replica, lying on the replica mesh axis; the outer momentum and the
in-flight averages are the same on every replica. The global params are the train state's `params`
(evaluation, sampling and export read them); the step evaluates the loss at `local_params`
(`loss_params`, through optim.outer).

A replica that misses a sync (`drop_prob`, or `drop(sync, replica)` in a test) is left out of that
average, whose weights are renormalized over the replicas present, and it takes the new global
params. In this SPMD simulation the missing replica still joins the collective with weight zero:
nothing blocks.
"""

import contextlib
import contextvars
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxtrain import collectives
from jaxtrain.optim import compress


class DilocoState(NamedTuple):
  inner_state: optax.OptState  # per replica [G, ...]
  # per replica [G, ...]: the params each replica trains (the step's loss sees them)
  local_params: dict
  momentum: jax.Array  # outer Nesterov momentum, flat [N]
  pending: jax.Array | None  # delay > 0: each fragment's average in flight, flat [N]
  pending_weight: jax.Array  # [P]: replicas in each fragment's pending average
  # per replica [G, P]: this replica missed the pending sync of the fragment
  pending_missed: jax.Array
  count: jax.Array  # int32: inner steps taken
  syncs: jax.Array  # int32: fragment syncs sent
  missed_syncs: jax.Array  # int32: replica-syncs left out so far (all replicas)


# (position of the step being traced in its call, the call's length): set while a call of several
# steps is traced unrolled from a step count that is a multiple of its length (builder.compile_call)
_POSITION = contextvars.ContextVar("diloco_call_position", default=None)


@contextlib.contextmanager
def call_position(i: int, length: int):
  """Within: the step being traced is step `i` of a call of `length` steps that starts at an inner
  step count divisible by `length`, so its count modulo any period dividing `length` is known while
  tracing. A fragment's sync then issues outside any conditional, where the compiler may run its
  collective beside the next steps' compute until the step that applies it (`delay` later)."""
  token = _POSITION.set((i, length))
  try:
    yield
  finally:
    _POSITION.reset(token)


def _phase(period: int) -> int | None:
  """The traced step's new count modulo `period`, when known while tracing (call_position)."""
  position = _POSITION.get()
  if position is None or position[1] % period:
    return None
  return (position[0] + 1) % period


def _when(pred, true_fn, false_fn, operand):
  """lax.cond, or the branch itself when `pred` is known while tracing (a Python bool)."""
  if isinstance(pred, bool):
    return true_fn(operand) if pred else false_fn(operand)
  return jax.lax.cond(pred, true_fn, false_fn, operand)


def loss_params(opt_state):
  """Inside the step (manual over the replica axis): this replica's own params, its [1, ...] entry
  of `local_params`, where its inner steps take the gradient."""
  local = optax.tree_utils.tree_get(opt_state, "local_params")
  return jax.tree.map(lambda x: x[0], local)


def diloco(inner: optax.GradientTransformation, *, axis: str, shards: int, inner_steps: int,
           outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
           fmt: str = "f32", block: int = 256, fragments: int = 1, delay: int = 0, mix: float = 0.5,
           drop_prob: float = 0.0, seed: int = 0,
           drop: Callable | None = None) -> optax.GradientTransformation:
  """DiLoCo over manual mesh `axis` (`shards` replicas) around `inner`, syncing every `inner_steps`
  (H) steps; `fragments` (P, dividing H) and `delay` (tau < H) make it streaming. Its `update(grads,
  state, params)` takes the gradient at the replica's `local_params` and the global `params`, and
  returns the global params' update (zero between syncs)."""
  if inner_steps < 1 or inner_steps % fragments or not 0 <= delay < inner_steps:
    raise ValueError(
        f"diloco: need H >= 1 divisible by fragments and 0 <= delay < H; got H={inner_steps}, "
        f"fragments={fragments}, delay={delay}")
  period = inner_steps // fragments  # one fragment syncs every `period` inner steps
  pad = compress.multiple(fmt, shards, block) * fragments

  def init(params):
    n = compress.Layout(nn.unbox(params), pad).padded
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    i32 = jnp.zeros([], jnp.int32)
    return DilocoState(compress.per_shard(inner.init(params), shards, axis),
                       compress.per_shard(params, shards, axis), zeros(n),
                       zeros(n) if delay else None, zeros(fragments),
                       compress.per_shard(jnp.zeros([fragments], jnp.bool_), shards, axis), i32,
                       i32, i32)

  def dropped(syncs):
    """Whether this replica misses sync number `syncs`."""
    replica = collectives.axis_index(axis)
    if drop is not None:
      return jnp.asarray(drop(syncs, replica), jnp.bool_)
    if drop_prob == 0:
      return jnp.asarray(replica) < 0  # False, varying over the axis like the other answers
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), syncs), replica)
    return jax.random.bernoulli(key, drop_prob)

  def send(layout, params, local, syncs, fragment):
    """This fragment's outer gradient averaged over the replicas present: (average, replicas
    present, whether this one missed)."""
    size = layout.padded // fragments
    delta = jax.lax.dynamic_slice(
        layout.flatten(params) - layout.flatten(local), (fragment * size,), (size,))
    missed = dropped(syncs)
    keep = 1.0 - missed.astype(jnp.float32)
    # counted once per `period` steps (parallel/hlo_bytes.py) where a conditional runs it that
    # often; in a call traced at its positions each sync is in the program as often as it runs
    scope = f"comm_every_{period}" if _phase(period) is None else "diloco_sync"
    with jax.named_scope(scope):
      total = compress.reduce_flat(delta * keep, axis, fmt, block)[0]
      present = (collectives.psum(keep, (axis,)) if (drop is not None or drop_prob)
                 else jnp.float32(shards))
    return total / jnp.maximum(present, 1.0), present, missed

  def outer_step(layout, momentum, average, present, fragment):
    """The outer Nesterov step on one fragment: (global params' update, momentum)."""
    size = layout.padded // fragments
    start = (fragment * size,)
    old = jax.lax.dynamic_slice(momentum, start, (size,))
    m = outer_momentum * old + average
    step = -outer_lr * (average + outer_momentum * m if nesterov else m)
    anyone = present > 0  # nobody sent: the fragment stays as it is
    m, step = jnp.where(anyone, m, old), jnp.where(anyone, step, 0.0)
    updates = layout.unflatten(
        jax.lax.dynamic_update_slice(jnp.zeros([layout.padded], jnp.float32), step, start))
    return updates, jax.lax.dynamic_update_slice(momentum, m, start)

  def rejoin(layout, local, new_global, missed, fragment):
    """The replica's copy of one fragment after its sync: the new global params (merged with the
    local copy when the average landed late; a replica that missed the sync takes the global).
    Copies only, without delay: each replica holds exactly the global params' bits."""
    size = layout.padded // fragments
    start = (fragment * size,)
    synced = jax.lax.dynamic_slice(layout.flatten(new_global), start, (size,))
    if delay:
      mine = jax.lax.dynamic_slice(layout.flatten(local), start, (size,))
      synced = jnp.where(missed, synced, mix * mine + (1.0 - mix) * synced)
    return layout.unflatten(jax.lax.dynamic_update_slice(layout.flatten(local), synced, start))

  def update(grads, state, params=None):
    layout = compress.Layout(params, pad)
    local, inner_state = compress.own(state.local_params), compress.own(state.inner_state)
    steps, inner_state = inner.update(grads, inner_state, local)
    local = optax.apply_updates(local, steps)
    count = state.count + 1
    zero = optax.tree.zeros_like(params)
    pending, weight, missed_all = state.pending, state.pending_weight, compress.own(
        state.pending_missed)
    momentum, syncs, missed_syncs = state.momentum, state.syncs, state.missed_syncs
    fragment_of = lambda c: (c // period - 1) % fragments
    phase = _phase(period)  # None: decided at run time

    if delay == 0:
      due, k = (count % period == 0) if phase is None else phase == 0, fragment_of(count)

      def sync(args):
        momentum, syncs, missed_syncs, _ = args
        average, present, missed = send(layout, params, local, syncs, k)
        updates, momentum = outer_step(layout, momentum, average, present, k)
        missed_syncs = missed_syncs + (shards - present).astype(jnp.int32)
        return updates, momentum, syncs + 1, missed_syncs, missed
      updates, momentum, syncs, missed_syncs, missed = _when(
          due, sync, lambda args: (zero, *args),
          (momentum, syncs, missed_syncs, jnp.zeros_like(missed_all[0])))
    else:
      def issue(args):
        pending, weight, missed_all, syncs, missed_syncs = args
        j = fragment_of(count)
        average, present, missed = send(layout, params, local, syncs, j)
        size = layout.padded // fragments
        pending = jax.lax.dynamic_update_slice(pending, average, (j * size,))
        return (pending, weight.at[j].set(present), missed_all.at[j].set(missed), syncs + 1,
                missed_syncs + (shards - present).astype(jnp.int32))
      pending, weight, missed_all, syncs, missed_syncs = _when(
          (count % period == 0) if phase is None else phase == 0, issue, lambda args: args,
          (pending, weight, missed_all, syncs, missed_syncs))

      started = count - delay >= period  # no fragment lands in the first period
      if phase is None:
        due = ((count - delay) % period == 0) & started
      else:
        due = started if (phase - delay) % period == 0 else False
      k = fragment_of(count - delay)
      size = layout.padded // fragments
      land = lambda m: outer_step(layout, m, jax.lax.dynamic_slice(pending, (k * size,), (size,)),
                                  weight[k], k)
      updates, momentum = _when(due, land, lambda m: (zero, m), momentum)
      missed = missed_all[k]

    # The new global params as the step's apply_updates makes them: the same add of the same
    # (conditional's output) buffers, outside the branch so that no multiply fuses into it (XLA
    # contracts a*b+c to an FMA).
    new_global = optax.apply_updates(params, updates)
    local = _when(due, lambda l: rejoin(layout, l, new_global, missed, k), lambda l: l, local)
    return updates, DilocoState(compress.mine(inner_state), compress.mine(local), momentum, pending,
                                weight, compress.mine(missed_all), count, syncs, missed_syncs)

  return optax.GradientTransformation(init, update)
