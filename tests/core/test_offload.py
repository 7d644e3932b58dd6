"""Host offload on the CPU host: refused for a CPU run in one line (XLA:CPU executes no memory
kinds), the state's shardings put exactly the offloaded fields in pinned host memory, and the
activation policy sends each layer's input to the host without changing a value. What offload saves
on a TPU is measured on the compiled step: tests/targets/test_offload.py."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import builder
from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.core import state as state_lib
from jaxtrain.model.transformer import Transformer
from jaxtrain.plan import predict
from tests.fixtures import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("mode", ["optimizer", "params", "activations"])
def test_offload_is_refused_on_cpu_in_one_line(mode):
  cfg = tiny_config(train=dict(offload=mode), model=dict(remat="full"))
  want = f"train.offload={mode}: host offload needs a TPU or GPU"
  with pytest.raises(ConfigError, match=want) as e:
    builder.build(cfg)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode, fields", [("none", ()), ("optimizer", ("opt_state",)),
                                          ("params", ("params",)), ("activations", ())])
def test_offloaded_fields_live_in_pinned_host_memory(mode, fields):
  """Every array of an offloaded field is in pinned host memory with its own layout; scalars (the
  step's counters) and every other field stay on the device."""
  cfg = tiny_config()
  mesh, task, tx, _ = builder.build(cfg)
  device = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules)
  placed = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules, mode)
  shapes = state_lib.abstract_state(task, tx)
  host = 0
  for field in ("step", "params", "opt_state", "rng", "extra", "task_state"):
    for d, p, s in zip(*(jax.tree.leaves(getattr(t, field)) for t in (device, placed, shapes))):
      offloaded = field in fields and s.ndim > 0
      assert p.memory_kind == ("pinned_host" if offloaded else d.memory_kind), (field, s.shape)
      assert p.spec == d.spec
      host += offloaded
  assert bool(host) == bool(fields)


def test_activation_offload_sends_layer_inputs_to_the_host_and_changes_no_value():
  """Under remat full the one residual of a layer is its input: with offload_activations the
  backward pass's jaxpr moves it to the host and back (two transfers per scanned layer stack),
  and the loss and gradients are the same values (the transfers are identities)."""
  m = ModelConfig.from_config(tiny_config(model=dict(remat="full")).model)
  tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % m.vocab_size
  params = nn.unbox(Transformer(m).init(jax.random.key(0), tokens))
  out = {}
  for offload in (False, True):
    model = Transformer(m, offload_activations=offload)
    loss = lambda p: jnp.mean(model.apply(p, tokens) ** 2)
    text = str(jax.make_jaxpr(jax.grad(loss))(params))
    out[offload] = jax.value_and_grad(loss)(params)
    assert ("Space.Host" in text, "Space.Device" in text) == (offload, offload)
  assert out[True][0] == out[False][0]
  jax.tree.map(np.testing.assert_array_equal, out[True][1], out[False][1])


def test_planner_keeps_offloaded_activations_off_the_device():
  """llama_1b on 4 v5p chips: activation offload takes the saved layer inputs (layers x local
  tokens x D in bf16) off the device and reports them as host bytes; optimizer offload reports the
  moments as host bytes and, as XLA:TPU compiles it (the moments brought in whole), keeps the device
  total."""
  cfg = jaxtrain.get_config(f"{ROOT}/configs/llama_1b.py")
  cfg.model.remat, cfg.train.batch_size = "full", 16
  plans = {}
  for mode in ("none", "activations", "optimizer"):
    cfg.train.offload = mode
    plans[mode] = predict(cfg, 4, "tpu-v5p", suggest=False)
  inputs = 16 * (16 * 2048 // 4) * 2048 * 2  # layers x tokens a chip x D x bf16
  assert plans["activations"].host_bytes == inputs
  assert plans["none"].memory["total"] - plans["activations"].memory["total"] == inputs
  # the moments, less a few bytes of scalars (step, RNG key, counters) that stay on the device
  assert 0 <= plans["none"].memory["opt_state"] - plans["optimizer"].host_bytes < 64
  assert plans["optimizer"].memory == plans["none"].memory
  assert "host memory" in plans["activations"].table()
  assert "host memory" not in plans["none"].table()
