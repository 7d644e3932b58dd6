"""MoE models in training: expert-parallel == unsharded (whole model), load balancing by the auxiliary
loss and by the expert bias, MoE state in checkpoints, and moe_tiny's convergence (slow)."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtrain
from jaxtrain import data, metrics, parallel
from jaxtrain.config_files import load_config_file
from jaxtrain.model import ModelConfig
from jaxtrain.model.moe import MoeMlp
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from jaxtrain.core.lm import update_expert_bias
from jaxtrain.core.step import accumulate_gradients
from tests.fixtures import ROOT, Batches, tiny_config

MOE = dict(n_kv_heads=4, n_experts=8, top_k=2, d_ff_expert=16, n_shared_experts=1, moe_every=1)


def loss_and_grads(mesh_sizes, rules, **model):
  cfg = tiny_config(model={**MOE, **model}, mesh=dict(rules=rules))
  devices = jax.devices()[: int(np.prod(list(mesh_sizes.values())))]
  cfg.mesh.update({"data": 1, **mesh_sizes})
  cfg.train.z_loss = 1e-4
  mesh, task, tx, _ = builder.build(cfg, "", devices)
  state, _ = state_lib.create_state(task, tx, 0, mesh, rules)
  batches = Batches(data.make_source(cfg, "train"), cfg.train.batch_size, parallel.batch_sharding(mesh))
  with parallel.activate(mesh, rules):
    grads, sums = jax.jit(lambda s, b: accumulate_gradients(task.loss, s, b, 1))(state, batches(0))
  grads = jax.tree.map(lambda g: g / sums["count"], grads)
  return (float(sums["ce"] / sums["count"]), jax.device_get(grads), jax.device_get(sums["moe"]),
          state.params["layers"]["moe"]["up"].sharding.spec)


@pytest.mark.slow  # ~80 s each on 2 cores; tests/test_moe.py checks the layer on the same meshes by default
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_parallel_model_equals_unsharded(dispatch):
  ref_loss, ref_grads, ref_moe, _ = loss_and_grads(dict(data=1), "fsdp_ep", dispatch=dispatch)
  for sizes, rules in [(dict(data=2, expert=4), "fsdp_ep"), (dict(expert=2, fsdp=2, tensor=2), "fsdp_tp_ep")]:
    loss, grads, moe, spec = loss_and_grads(sizes, rules, dispatch=dispatch)
    assert spec[1] == "expert", spec  # [layers, expert, embed, mlp]: the experts really are split
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(sizes))
    for key in ("aux_loss", "z_loss", "load", "dropped", "entropy"):
      np.testing.assert_allclose(moe[key], ref_moe[key], rtol=1e-5, atol=1e-7, err_msg=f"{sizes} {key}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7, err_msg=str(sizes)),
                 grads, ref_grads)


def imbalance_over_training(aux_weight: float, bias_rate: float, steps: int = 60, lr: float = 3e-4):
  """A skewed router (every token shares a direction that the router maps to experts 0 and 1): returns
  the imbalance (max expert load x experts; 1 = balanced) at the first step and over the last 5 of
  `steps` steps of a regression task, with the auxiliary loss weighted by `aux_weight` and/or the
  expert bias moved by `bias_rate`."""
  c = ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=16, d_ff=32,
                  max_seq_len=64, n_experts=8, top_k=2, d_ff_expert=16, bias_update_rate=bias_rate)
  layer = MoeMlp(c)
  rng = np.random.default_rng(0)
  shared_D = rng.normal(size=16) * 2
  x = jnp.asarray(shared_D + rng.normal(size=(4, 64, 16)), jnp.float32)
  target = jnp.tanh(x @ jnp.asarray(rng.normal(size=(16, 16)), jnp.float32))
  variables = nn.unbox(layer.init(jax.random.key(0), x))
  params, extra = variables["params"], {k: v for k, v in variables.items() if k == "moe_state"}
  skew_E = np.zeros(8)
  skew_E[:2] = 1.0  # logit +1 for experts 0 and 1 along the shared direction
  params["router"] = params["router"] + jnp.asarray(np.outer(shared_D / (shared_D @ shared_D), skew_E), jnp.float32)
  tx = optax.adam(lr)
  opt_state = tx.init(params)

  def loss_fn(params, extra):
    y, stats = layer.apply({"params": params, **extra}, x)
    return jnp.mean((y - target) ** 2) + aux_weight * stats["aux_loss"], stats

  @jax.jit
  def step(params, opt_state, extra):
    (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, extra)
    updates, opt_state = tx.update(grads, opt_state)
    if bias_rate:
      extra = update_expert_bias(extra, stats["load"], bias_rate)
    return optax.apply_updates(params, updates), opt_state, extra, stats["load"]

  loads = []
  for _ in range(steps):
    params, opt_state, extra, load = step(params, opt_state, extra)
    loads.append(np.asarray(load))
  imbalance = [float(np.max(l) * c.n_experts) for l in loads]
  return imbalance[0], float(np.mean(imbalance[-5:]))


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_balancing_loss_and_expert_bias_each_reduce_imbalance():
  # each against a control run at the same learning rate with neither mechanism
  for aux_weight, bias_rate, lr in [(1.0, 0.0, 1e-3), (0.0, 5e-3, 3e-4)]:
    start, control = imbalance_over_training(aux_weight=0.0, bias_rate=0.0, lr=lr)
    assert start >= 3.0 and control >= 3.0, (start, control)  # skewed: two experts take nearly all
    first, balanced = imbalance_over_training(aux_weight, bias_rate, lr=lr)
    assert first == start and balanced < 0.7 * control and balanced < 2.5, (aux_weight, bias_rate, balanced)


@pytest.mark.slow  # ~50 s on 2 cores (two expert-parallel trainings); kept out of the default suite's 10 minutes
def test_moe_run_logs_router_metrics_and_resumes_bitwise_with_its_expert_bias(tmp_path):
  cfg = tiny_config(model={**MOE, "bias_update_rate": 1e-2, "dispatch": "capacity", "capacity_factor": 1.0},
                    train=dict(steps=4, eval_every=2), checkpoint=dict(every_steps=2),
                    mesh=dict(data=1, expert=2, rules="fsdp_ep"))
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  run = dict(progress=False, sync_every_step=True, devices=jax.devices()[:2])
  final = jaxtrain.train(cfg, straight, **run)
  rows = [r for r in metrics.read_metrics(straight) if "loss" in r]
  for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_router_entropy", "moe_imbalance"):
    assert all(np.isfinite(r[key]) for r in rows), key
  assert all(len(r["moe_load"]) == 8 and abs(sum(r["moe_load"]) - 1) < 1e-5 for r in rows)
  assert any(r["moe_dropped"] > 0 for r in rows)  # capacity factor 1: some tokens over capacity
  assert final["active_params"] < final["params"]

  import shutil
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, **run)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[2:]]
  assert [r["moe_load"] for r in again] == [r["moe_load"] for r in rows[2:]]

  # load_pretrained binds the trained expert biases (they choose the experts) into apply
  from jaxtrain.checkpoint import convert
  bias = jax.tree.leaves(convert.load_extra(straight))
  assert len(bias) == 1 and bias[0].shape == (2, 8) and np.any(bias[0] != 0)
  _, params, apply = jaxtrain.load_pretrained(straight)
  assert np.all(np.isfinite(apply(params, jnp.ones((1, 8), jnp.int32))))


@pytest.mark.slow
@pytest.mark.long  # the whole moe_tiny run: 481 s on 2 loaded cores (2026-12-04), `make test-long`
def test_moe_tiny_reaches_the_entropy_floor(tmp_path):
  cfg = load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
  final = jaxtrain.train(cfg, str(tmp_path), progress=False)
  assert final["eval_loss"] < 1.05 * final["eval_entropy_floor"], final
