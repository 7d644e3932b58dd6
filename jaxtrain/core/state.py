"""The train state pytree and its birth directly in its shardings.

Every leaf's sharding comes from logical annotations (flax's lm1b recipe): the task's init returns
boxed variables (nn.with_logical_partitioning), the optimizer is initialized on those boxes under
eval_shape so that its moments carry their parameter's names, and unboxed leaves (counters, the RNG)
are replicated. Nothing is matched by key path or shape.
"""

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxtrain import parallel
from jaxtrain.core import offload as offload_lib


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  rng: jax.Array  # raw key data (uint32), so that checkpoints hold plain arrays
  # non-trainable model collections (moe_state)
  extra: dict = flax.struct.field(default_factory=dict)
  # per replica, outside the optimizer (empty today)
  replica_state: dict = flax.struct.field(default_factory=dict)
  # the task's own (a frozen reference model, ...)
  task_state: dict = flax.struct.field(default_factory=dict)


def init_fn(task, tx: optax.GradientTransformation, boxed: bool = False):
  """`seed -> TrainState`, pure, for jit and eval_shape; `boxed` keeps the logical-axis boxes."""
  def init(seed):
    init_rng, state_rng = jax.random.split(jax.random.key(seed))
    params, extra, task_state = task.init(init_rng)
    opt_state = tx.init(params if boxed else nn.unbox(params))
    state = TrainState(jnp.zeros((), jnp.int32), params, opt_state, jax.random.key_data(state_rng),
                       extra, {}, task_state)
    return state if boxed else nn.unbox(state)
  return init


def abstract_state(task, tx) -> TrainState:
  """The state's shapes and dtypes, allocating nothing."""
  return jax.eval_shape(init_fn(task, tx), 0)


def state_shardings(task, tx, mesh, rules_name: str, offload: str = "none") -> TrainState:
  """Shardings of every leaf of the train state, from its logical annotations; what `offload`
  (train.offload) keeps on the host in pinned host memory."""
  boxed = jax.eval_shape(init_fn(task, tx, boxed=True), 0)
  shardings = parallel.logical_shardings(_logical_specs(boxed), mesh, rules_name)
  # unboxed without a constraint: nn.unbox would constrain the shapes to the active mesh (an error
  # outside jit, as when the loop rolls back inside parallel.activate)
  shapes = jax.tree.map(lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned)
                        else x, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  return offload_lib.place(shardings, shapes, offload)


def _logical_specs(tree):
  """nn.get_partition_spec, except that a box around no array (optax.masked puts an empty MaskedNode
  where a transformation does not apply) stays empty rather than becoming a spec with nothing to
  place."""
  def spec(x):
    if isinstance(x, nn.Partitioned):
      return x.get_partition_spec() if jax.tree.leaves(x.value) else x.value
    return P() if hasattr(x, "shape") else x
  return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def create_state(task, tx, seed: int, mesh, rules_name: str,
                 offload: str = "none") -> tuple[TrainState, TrainState]:
  """The train state born sharded (eval_shape -> shardings -> jitted init), and its shardings."""
  shardings = state_shardings(task, tx, mesh, rules_name, offload)
  # No mesh context: init traces a one-row forward pass (then dropped), which must not take the
  # expert-parallel path; the out_shardings alone place every leaf.
  with nn.logical_axis_rules(parallel.mesh.rules(mesh, rules_name)):
    state = jax.jit(init_fn(task, tx), out_shardings=shardings)(seed)
  return state, shardings
