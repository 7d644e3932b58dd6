"""Train step: accumulation equals one big batch, non-finite skip, decay mask, schedules, Muon."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data, optim
from jaxtrain.train import loop, state as state_lib
from jaxtrain.train.step import train_step
from tests.fixtures import tiny_config


def run_steps(cfg, n, poison=None):
  devices = jax.devices()[:1]
  mesh, model, tx, schedule = loop.build(cfg, devices)
  state, _ = state_lib.create_state(model, tx, cfg.train.seq_len, 0, mesh, cfg.mesh.rules)
  source = data.make_source(cfg, "train")
  step = jax.jit(functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                                   microbatches=cfg.train.microbatches, z_loss=cfg.train.z_loss))
  history = []
  for i in range(n):
    batch = {k: jnp.asarray(v) for k, v in source.batch(i, 0, cfg.train.batch_size).items()}
    if poison is not None and i == poison:
      batch["loss_mask"] = batch["loss_mask"].at[0, 0].set(jnp.nan)
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  return state, history


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
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


def test_weight_decay_mask_excludes_norms():
  cfg = tiny_config()
  _, model, _, _ = loop.build(cfg, jax.devices()[:1])
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


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizers_reduce_loss(name):
  cfg = tiny_config(mesh=dict(data=1), optim=dict(name=name, lr=2e-2, warmup_steps=1), train=dict(steps=30))
  cfg.data.update(symbols=8, max_symbols=8)
  _, history = run_steps(cfg, 30)
  assert history[-1]["loss"] < 0.8 * history[0]["loss"], (history[0]["loss"], history[-1]["loss"])
