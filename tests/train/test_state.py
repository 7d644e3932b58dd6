"""State shardings come from logical annotations: optimizer moments take their parameter's names through a
boxed init (flax lm1b); the task's own state and the per-replica slot are placed by their names too."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import parallel
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from jaxtrain.core.lm import LanguageModel
from tests.fixtures import tiny_config


def path_matched(task, tx, mesh, rules):
  """The former rule, as a reference: an optimizer leaf whose trailing dict keys name a parameter of
  the same shape takes that parameter's sharding; anything else is replicated."""
  boxed = jax.eval_shape(state_lib.init_fn(task, tx, boxed=True), 0)
  params = parallel.logical_shardings(nn.get_partition_spec(boxed.params), mesh, rules)
  keys = lambda path: tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))
  by_path = {keys(path): (leaf.shape, sh) for (path, leaf), sh in
             zip(jax.tree_util.tree_leaves_with_path(nn.unbox(boxed.params)), jax.tree.leaves(params))}

  def follow(path, leaf):
    k = keys(path)
    for start in range(len(k)):
      shape, sharding = by_path.get(k[start:], (None, None))
      if shape == leaf.shape:
        return sharding
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(follow, state_lib.abstract_state(task, tx).opt_state)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_shardings_from_annotations_equal_the_parameters(name):
  cfg = tiny_config(mesh=dict(data=2, fsdp=2, tensor=2, rules="fsdp_tp"), optim=dict(name=name))
  mesh, task, tx, _ = builder.build(cfg)
  got = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules).opt_state
  want = path_matched(task, tx, mesh, cfg.mesh.rules)
  shapes = state_lib.abstract_state(task, tx).opt_state
  split = 0
  for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(shapes)):
    assert g.is_equivalent_to(w, len(s.shape)), (g, w, s.shape)
    split += not g.is_fully_replicated
  assert split >= 10  # the moments really are split (fsdp x tensor), not all replicated


class WithReference(LanguageModel):
  """A task that carries a frozen copy of the initial params (a DPO reference) and a per-replica value."""

  def init(self, rng):
    params, extra, _ = super().init(rng)
    return params, extra, {"reference": params}


def test_task_state_is_placed_like_the_params_it_holds():
  cfg = tiny_config(mesh=dict(data=2, fsdp=4))
  mesh = parallel.make_mesh(cfg.mesh)
  task = WithReference(cfg, "")
  tx = builder.build(cfg)[2]
  state, shardings = state_lib.create_state(task, tx, 0, mesh, cfg.mesh.rules)
  jax.tree.map(lambda a, b, x: a.is_equivalent_to(b, x.ndim) or pytest.fail(f"{a} != {b}"),
               shardings.task_state["reference"], shardings.params, state.params)
  assert state.task_state["reference"]["layers"]["mlp"]["up"].sharding.spec[1] == "fsdp"
  jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("reference != params"),
               state.task_state["reference"], state.params)
  assert state.replica_state == {}


def test_replica_slot_is_sharded_over_the_replica_axis():
  cfg = tiny_config(mesh=dict(replica=2, data=4))
  mesh = parallel.make_mesh(cfg.mesh)
  from jaxtrain.model import axes
  spec = nn.get_partition_spec(nn.with_logical_partitioning(jnp.zeros, (axes.REPLICA, axes.EMBED))((2, 32)))
  sharding = parallel.logical_shardings(spec, mesh, cfg.mesh.rules)
  assert sharding.spec[0] == "replica"
