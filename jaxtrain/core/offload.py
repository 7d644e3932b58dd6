"""Host offload (train.offload): which part of the train state lives in the host's pinned memory
between steps, and how the step brings it to the device when it needs it.

`optimizer`: the optimizer state waits on the host; `around_tx` brings it in for the update (behind
a barrier on the gradient) and sends the new state back. XLA:TPU's host-offload passes still start
the copy-in at the top of the step, so the device holds a copy during the step: offload frees the
device between steps, not at the step's peak (measured).
`params`: the parameters, brought in whole at the start of the step (`around`). `activations` moves
no state: the layer stack's remat policy sends each layer's input to the host instead
(model/transformer.py). Memory kinds are executed by the TPU and GPU runtimes, not by XLA:CPU
(builder.check_offload refuses offload there). What each mode saves and moves:
benchmarks/RESULTS.md, "Host offload"."""

import jax
import optax

HOST, DEVICE = "pinned_host", "device"
# train.offload -> the TrainState fields kept on the host between steps
FIELDS = {"none": (), "optimizer": ("opt_state",), "params": ("params",), "activations": ()}


def place(shardings, shapes, mode: str):
  """The state's shardings (a TrainState) with the arrays of the fields `mode` offloads in pinned
  host memory; scalars (step counters the step reads into its metrics) stay on the device."""
  def host(sharding, shape):
    return sharding.with_memory_kind(HOST) if shape.ndim else sharding
  return shardings.replace(**{
      f: jax.tree.map(host, getattr(shardings, f), getattr(shapes, f)) for f in FIELDS[mode]})


def _put(tree, space):
  return jax.tree.map(lambda x: jax.device_put(x, space) if x.ndim else x, tree)


def to_device(tree):
  """`tree`'s arrays (inside jit) copied into device memory, each keeping its sharding."""
  return _put(tree, jax.memory.Space.Device)


def to_host(tree):
  """`tree`'s arrays (inside jit) sent to pinned host memory; scalars stay."""
  return _put(tree, jax.memory.Space.Host)


def around_tx(tx: optax.GradientTransformation, mode: str) -> optax.GradientTransformation:
  """`tx` whose state (kept on the host under `mode`) is brought to the device for the update, in
  the program's order after the gradient, and whose new state is sent back to the host (scalar
  counters stay: the step reads them into its metrics)."""
  if "opt_state" not in FIELDS[mode]:
    return tx

  def update(grads, state, params=None):
    grads, state = jax.lax.optimization_barrier((grads, state))
    updates, state = tx.update(grads, to_device(state), params)
    return updates, to_host(state)
  return optax.GradientTransformation(tx.init, update)


def around(step, mode: str):
  """`step(state, batch)` with offloaded params brought to the device first (the jitted step's
  out_shardings send the new ones back)."""
  if "params" not in FIELDS[mode]:
    return step
  return lambda state, batch: step(state.replace(params=to_device(state.params)), batch)


def around_eval(eval_sums, mode: str):
  """`eval_sums(params, ...)` with offloaded params brought to the device first."""
  if "params" not in FIELDS[mode]:
    return eval_sums
  return lambda params, *rest: eval_sums(to_device(params), *rest)
