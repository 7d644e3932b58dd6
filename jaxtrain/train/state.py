"""The train state pytree and its birth directly in its shardings."""

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import parallel


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  rng: jax.Array  # raw key data (uint32), so that checkpoints hold plain arrays
  extra: dict = flax.struct.field(default_factory=dict)  # non-trainable model collections (moe_state)


NON_TRAINABLE = ("moe_state",)  # model collections kept in the state and updated outside the optimizer


def init_fn(model: nn.Module, tx: optax.GradientTransformation, seq_len: int, boxed: bool = False):
  """`seed -> TrainState`, pure, for jit and eval_shape; `boxed` keeps the logical-axis boxes."""
  def init(seed):
    init_rng, state_rng = jax.random.split(jax.random.key(seed))
    variables = model.init(init_rng, jnp.zeros((1, seq_len), jnp.int32))
    params = variables["params"]
    extra = {k: v if boxed else nn.unbox(v) for k, v in variables.items() if k in NON_TRAINABLE}
    opt_state = tx.init(nn.unbox(params))
    return TrainState(jnp.zeros((), jnp.int32), params if boxed else nn.unbox(params), opt_state,
                      jax.random.key_data(state_rng), extra)
  return init


def state_shardings(model, tx, seq_len, mesh, rules_name) -> TrainState:
  """Shardings of the train state from the params' logical names, allocating nothing.

  Optimizer leaves shaped like a parameter (Adam's moments) take that parameter's sharding."""
  abstract = jax.eval_shape(init_fn(model, tx, seq_len, boxed=True), 0)
  logical = nn.get_partition_spec(abstract.params)
  params = parallel.logical_shardings(logical, mesh, rules_name)
  replicated = NamedSharding(mesh, P())
  by_path = {_dict_keys(path): (leaf.shape, sharding) for (path, leaf), sharding in
             zip(jax.tree_util.tree_leaves_with_path(nn.unbox(abstract.params)), jax.tree.leaves(params))}

  def follow_param(path, leaf):
    """A leaf whose trailing dict keys name a parameter of the same shape is that param's moment."""
    keys = _dict_keys(path)
    for start in range(len(keys)):
      shape, sharding = by_path.get(keys[start:], (None, None))
      if shape == leaf.shape:
        return sharding
    return replicated

  opt_state = jax.tree_util.tree_map_with_path(follow_param, abstract.opt_state)
  extra = jax.tree.map(lambda _: replicated, nn.unbox(abstract.extra))
  return TrainState(replicated, params, opt_state, replicated, extra)


def _dict_keys(path) -> tuple:
  return tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))


def create_state(model, tx, seq_len, seed, mesh, rules_name) -> tuple[TrainState, TrainState]:
  """The train state born sharded (eval_shape -> shardings -> jitted init), and its shardings."""
  shardings = state_shardings(model, tx, seq_len, mesh, rules_name)
  # No mesh context: init traces a one-row forward pass (then dropped), which must not take the
  # expert-parallel path; the out_shardings alone place every leaf.
  with nn.logical_axis_rules(parallel.RULES[rules_name]):
    state = jax.jit(init_fn(model, tx, seq_len), out_shardings=shardings)(seed)
  return state, shardings
