"""DiLoCo as an optax transformation on 4 replicas, each pulling its own copy of a small layered model
toward its own target: the outer step is the averaged outer gradient's Nesterov step, replicas are
bitwise identical after every sync, streaming syncs one fragment at a time, a delayed fragment lands
tau steps later, and a replica that misses a sync is left out and rejoins."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxtrain import collectives
from jaxtrain.optim import compress, diloco

R = 4
LR, MU = 0.7, 0.9


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.asarray(jax.devices()).reshape(R, 2), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)


def model():
  rng = np.random.default_rng(0)
  return {"layers": {"w": jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)},
          "b": jnp.asarray(rng.standard_normal(64), jnp.float32)}


def targets():
  rng = np.random.default_rng(1)
  return {"layers": {"w": jnp.asarray(rng.standard_normal((R, 2, 64)), jnp.float32)},
          "b": jnp.asarray(rng.standard_normal((R, 64)), jnp.float32)}


class Run:
  """Steps of a replicated quadratic problem under `tx`, one jitted call each, inspectable between."""

  def __init__(self, mesh, tx):
    self.mesh, self.tx = mesh, tx
    self.params = model()
    boxed = tx.init(self.params)
    specs = jax.tree.map(lambda b: P("replica") if isinstance(b, nn.Partitioned) and b.names[0] == "replica"
                         else P(), boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))
    self.state = nn.unbox(boxed)

    def step(params, state, target):
      local = jax.tree.map(lambda x: x[0], state.local_params)
      target = jax.tree.map(lambda x: x[0], target)
      grads = jax.grad(lambda p: sum(jnp.sum((a - b) ** 2) / 2 for a, b in
                                     zip(jax.tree.leaves(p), jax.tree.leaves(target))))(local)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, updates

    with jax.set_mesh(mesh):  # shard_map takes the mesh of its context
      self.fn = jax.jit(collectives.shard_map(step, ("replica",), (P(), specs, P("replica")), (P(), specs, P())))

  def step(self):
    before = jax.tree.map(np.asarray, (self.params, self.state.local_params))
    with jax.set_mesh(self.mesh):
      self.params, self.state, self.updates = self.fn(self.params, self.state, targets())
    return before

  def locals_(self):
    return jax.tree.map(np.asarray, self.state.local_params)


def sgd_diloco(**kw):
  return diloco(optax.sgd(0.1), axis="replica", shards=R, outer_lr=LR, outer_momentum=MU, **kw)


def assert_replicas_equal_global(run):
  local, params = run.locals_(), jax.tree.map(np.asarray, run.params)
  for r in range(R):
    jax.tree.map(lambda l, g: np.testing.assert_array_equal(l[r], g), local, params)


def test_after_every_sync_replicas_are_bitwise_the_global_params(mesh):
  run = Run(mesh, sgd_diloco(inner_steps=3))
  for count in range(1, 10):
    global_before, local_before = run.step()
    if count % 3:
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), global_before, jax.tree.map(np.asarray, run.params))
      assert not np.array_equal(run.locals_()["b"][0], run.locals_()["b"][1])  # replicas went their own ways
    else:
      assert_replicas_equal_global(run)
  assert int(run.state.syncs) == 3 and int(run.state.count) == 9


def test_the_outer_step_is_nesterov_on_the_averaged_outer_gradient(mesh):
  run = Run(mesh, sgd_diloco(inner_steps=2))
  params0 = jax.tree.map(np.asarray, run.params)
  run.step()
  local_after_inner = None
  # the second step's inner update, then the sync: recompute it by hand from the replicas' own steps
  before = run.locals_()
  t = jax.tree.map(np.asarray, targets())
  local_after_inner = jax.tree.map(lambda l, tg: l - 0.1 * (l - tg), before, t)
  delta = jax.tree.map(lambda g, l: (g[None] - l).mean(0), params0, local_after_inner)
  want = jax.tree.map(lambda g, d: g - LR * (d + MU * d), params0, delta)  # m = delta after the first sync
  run.step()
  jax.tree.map(lambda got, w: np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6),
               jax.tree.map(np.asarray, run.params), want)


def test_streaming_syncs_one_fragment_at_a_time(mesh):
  run = Run(mesh, sgd_diloco(inner_steps=4, fragments=2))
  layout = compress.Layout(model(), compress.multiple("f32", R, 256) * 2)
  half = layout.padded // 2
  changed = []
  for _ in range(4):
    before, _ = run.step()
    diff = np.asarray(layout.flatten(jax.tree.map(jnp.asarray, run.params))
                      - layout.flatten(jax.tree.map(jnp.asarray, before)))
    changed.append((bool(np.any(diff[:half])), bool(np.any(diff[half:]))))
  # fragment 0 (layer 0 first: the flat vector is layer-major) at step 2, fragment 1 at step 4
  assert changed == [(False, False), (True, False), (False, False), (False, True)]
  assert layout.layers == 2 and layout.layer_size == 64


def test_a_delayed_fragment_lands_tau_steps_later_merged_with_the_local_copy(mesh):
  run = Run(mesh, sgd_diloco(inner_steps=4, fragments=1, delay=2, mix=0.25))
  for _ in range(4):
    run.step()
  assert not np.any(np.asarray(run.updates["b"]))  # sent at step 4, not applied yet
  run.step()
  assert not np.any(np.asarray(run.updates["b"]))
  before_local = run.locals_()
  t = jax.tree.map(np.asarray, targets())
  stepped = jax.tree.map(lambda l, tg: l - 0.1 * (l - tg), before_local, t)
  run.step()  # step 6 = 4 + tau: the average lands
  assert np.any(np.asarray(run.updates["b"]))
  params = jax.tree.map(np.asarray, run.params)
  want = jax.tree.map(lambda l, g: 0.25 * l + 0.75 * g[None], stepped, params)
  jax.tree.map(lambda got, w: np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6), run.locals_(), want)


def test_a_replica_that_misses_a_sync_is_left_out_and_rejoins(mesh):
  run = Run(mesh, sgd_diloco(inner_steps=2, drop=lambda sync, replica: (sync == 0) & (replica == 2)))
  params0 = jax.tree.map(np.asarray, run.params)
  run.step()
  before = run.locals_()
  t = jax.tree.map(np.asarray, targets())
  local = jax.tree.map(lambda l, tg: l - 0.1 * (l - tg), before, t)
  present = [0, 1, 3]
  delta = jax.tree.map(lambda g, l: (g[None] - l[present]).mean(0), params0, local)
  want = jax.tree.map(lambda g, d: g - LR * (d + MU * d), params0, delta)
  run.step()
  jax.tree.map(lambda got, w: np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6),
               jax.tree.map(np.asarray, run.params), want)
  assert_replicas_equal_global(run)  # the replica that missed it takes the global params too
  assert int(run.state.missed_syncs) == 1
  for _ in range(2):  # the next sync has everyone again
    run.step()
  assert int(run.state.missed_syncs) == 1 and int(run.state.syncs) == 2
  assert_replicas_equal_global(run)


def test_random_drops_renormalize_and_training_goes_on(mesh):
  run = Run(mesh, sgd_diloco(inner_steps=1, drop_prob=0.5, seed=3))
  for _ in range(12):
    run.step()
  missed = int(run.state.missed_syncs)
  assert 0 < missed < 12 * R
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.tree.map(np.asarray, run.params)))
  assert_replicas_equal_global(run)
