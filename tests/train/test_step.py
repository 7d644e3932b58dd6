"""Train step: accumulation equals one big batch, non-finite skip, decay mask, schedules, Muon."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import data, optim
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from jaxtrain.core.step import make_train_step
from tests.fixtures import tiny_config


def run_steps(cfg, n, poison=None, wrap=lambda tx: tx):
  """n steps on one device; `poison`: the step whose batch has a NaN; `wrap`: a transformation around
  the whole optimizer chain."""
  devices = jax.devices()[:1]
  mesh, task, tx, schedule = builder.build(cfg, "", devices)
  tx = wrap(tx)
  state, _ = state_lib.create_state(task, tx, 0, mesh, cfg.mesh.rules)
  source = data.make_source(cfg, "train")
  step = jax.jit(make_train_step(task.loss, tx, schedule, metrics_fn=task.metrics, update_extra=task.update_extra,
                                 microbatches=cfg.train.microbatches))
  history = []
  for i in range(n):
    batch = {k: jnp.asarray(v) for k, v in source.batch(i, 0, cfg.train.batch_size).items()}
    if poison is not None and i == poison:
      batch["loss_mask"] = batch["loss_mask"].at[0, 0].set(jnp.nan)
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  return state, history


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_microbatches_equal_one_big_batch():
  s1, h1 = run_steps(tiny_config(mesh=dict(data=1)), 3)
  s4, h4 = run_steps(tiny_config(mesh=dict(data=1), train=dict(microbatches=4)), 3)
  for a, b in zip(h1, h4):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
    np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), s1.params, s4.params)


def test_nonfinite_update_is_skipped_and_counted():
  cfg = tiny_config(mesh=dict(data=1))
  state, history = run_steps(cfg, 3, poison=1)
  assert [int(h["skipped_steps"]) for h in history] == [0, 1, 1]
  assert [int(h["consecutive_skips"]) for h in history] == [0, 1, 0]
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


@pytest.mark.slow  # ~26 s on 2 cores: the default suite stays under 10 minutes
def test_skipped_steps_read_by_name_through_a_wrapped_chain():
  """Wrapping the chain (here: nested in another chain behind a leading transformation) must not turn
  the counter into 0, as `getattr(opt_state, "total_notfinite", 0)` did."""
  wrap = lambda tx: optax.chain(optax.scale(1.0), optax.chain(tx))
  _, history = run_steps(tiny_config(mesh=dict(data=1)), 3, poison=1, wrap=wrap)
  assert [int(h["skipped_steps"]) for h in history] == [0, 1, 1]


def test_guard_covers_the_update_not_only_the_gradient():
  """A NaN learning rate leaves every gradient finite but makes the update NaN: the step is skipped,
  the parameters stay finite and equal to the initial ones (validation refuses lr=nan; this is the guard
  behind it)."""
  cfg = tiny_config(mesh=dict(data=1))
  cfg.optim.lr = float("nan")
  state0, _ = run_steps(cfg, 0)
  state, history = run_steps(cfg, 2)
  assert [int(h["skipped_steps"]) for h in history] == [1, 2]
  assert all(np.isfinite(float(h["grad_norm"])) for h in history)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(state0.params))


@pytest.mark.slow  # ~18 s on 2 cores: the default suite stays under 10 minutes
def test_weight_decay_mask_excludes_norms():
  cfg = tiny_config()
  model = builder.build(cfg, "", jax.devices()[:1])[1].model
  import flax.linen as nn
  params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  mask = optim.decay_mask(params)
  assert mask["layers"]["mlp"]["up"] and mask["embed"]
  assert not mask["final_norm"]["scale"] and not mask["layers"]["attn_norm"]["scale"]


def test_schedules():
  o = tiny_config().optim
  o.update(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
  cos = optim.make_schedule(o, 100)
  assert float(cos(0)) == 0.0 and abs(float(cos(10)) - 1.0) < 1e-6 and abs(float(cos(100)) - 0.1) < 1e-6
  o.schedule = "wsd"
  wsd = optim.make_schedule(o, 100)
  assert float(wsd(50)) == 1.0 and float(wsd(79)) == 1.0 and abs(float(wsd(100)) - 0.1) < 1e-6
  assert 0.1 < float(wsd(90)) < 1.0


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_a_one_step_run_takes_its_step_at_the_peak_rate(schedule):
  """`--config.train.steps=1` on a config with warmup (tiny's is 50): cosine raised optax's "requires
  positive decay_steps" and constant stepped at lr 0."""
  o = tiny_config().optim
  o.update(lr=3e-3, warmup_steps=50, schedule=schedule)
  assert float(optim.make_schedule(o, 1)(0)) == pytest.approx(3e-3)


@pytest.mark.parametrize("name", ["adamw", pytest.param("muon", marks=pytest.mark.slow)])  # muon: ~31 s
def test_optimizers_reduce_loss(name):
  cfg = tiny_config(mesh=dict(data=1), optim=dict(name=name, lr=2e-2, warmup_steps=1), train=dict(steps=30))
  cfg.data.update(symbols=8, max_symbols=8)
  _, history = run_steps(cfg, 30)
  assert history[-1]["loss"] < 0.8 * history[0]["loss"], (history[0]["loss"], history[-1]["loss"])
