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


def init_fn(model: nn.Module, tx: optax.GradientTransformation, seq_len: int, boxed: bool = False):
  """`seed -> TrainState`, pure, for jit and eval_shape; `boxed` keeps the logical-axis boxes."""
  def init(seed):
    init_rng, state_rng = jax.random.split(jax.random.key(seed))
    params = model.init(init_rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
    opt_state = tx.init(nn.unbox(params))
    return TrainState(jnp.zeros((), jnp.int32), params if boxed else nn.unbox(params), opt_state,
                      jax.random.key_data(state_rng))
  return init


def state_shardings(model, tx, seq_len, mesh, rules_name) -> TrainState:
  """Shardings of the train state from the params' logical names, allocating nothing.

  Optimizer leaves shaped like a parameter (Adam's moments) take that parameter's sharding."""
  abstract = jax.eval_shape(init_fn(model, tx, seq_len, boxed=True), 0)
  logical = nn.get_partition_spec(abstract.params)
  params = parallel.logical_shardings(logical, mesh, rules_name)
  replicated = NamedSharding(mesh, P())
  opt_state = optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract.opt_state, params,
      transform_non_params=lambda _: replicated)
  return TrainState(replicated, params, opt_state, replicated)


def create_state(model, tx, seq_len, seed, mesh, rules_name) -> tuple[TrainState, TrainState]:
  """The train state born sharded (eval_shape -> shardings -> jitted init), and its shardings."""
  shardings = state_shardings(model, tx, seq_len, mesh, rules_name)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES[rules_name]):
    state = jax.jit(init_fn(model, tx, seq_len), out_shardings=shardings)(seed)
  return state, shardings
