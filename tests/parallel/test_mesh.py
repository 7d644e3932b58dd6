"""Sharded equals unsharded: loss and gradients of one batch across meshes and rule presets."""


import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxtrain import data, parallel
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from jaxtrain.core.step import accumulate_gradients
from tests.fixtures import Batches, tiny_config

MESHES = [  # (mesh sizes, rules preset)
    (dict(data=1), "dp"),
    (dict(data=2, fsdp=4), "fsdp"),
    (dict(data=1, fsdp=2, tensor=4), "fsdp_tp"),
    (dict(data=2, fsdp=2, tensor=2), "fsdp_tp"),
]


def loss_and_grads(mesh_sizes, rules):
  cfg = tiny_config(model=dict(n_kv_heads=4, vocab_size=64), mesh=dict(rules=rules))
  devices = jax.devices()[: int(np.prod(list(mesh_sizes.values())))]
  cfg.mesh.update({"data": 1, **mesh_sizes})
  cfg.train.z_loss = 1e-4
  mesh, task, tx, _ = builder.build(cfg, "", devices)
  state, shardings = state_lib.create_state(task, tx, 0, mesh, rules)
  batches = Batches(data.make_source(cfg, "train"), cfg.train.batch_size, parallel.batch_sharding(mesh))
  with parallel.activate(mesh, rules):
    grads, sums = jax.jit(lambda s, b: accumulate_gradients(task.loss, s, b, 1))(state, batches(0))
  loss = sums["ce"] / sums["count"]
  grads = jax.tree.map(lambda g: g / sums["count"], grads)
  spec = state.params["layers"]["mlp"]["up"].sharding.spec
  return float(loss), jax.device_get(grads), spec


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_sharded_equals_unsharded():
  ref_loss, ref_grads, _ = loss_and_grads(*MESHES[0])
  for sizes, rules in MESHES[1:]:
    loss, grads, spec = loss_and_grads(sizes, rules)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(sizes))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7, err_msg=str(sizes)),
                 grads, ref_grads)
    if rules == "fsdp_tp":  # the parameters really are split: [layers, embed->fsdp, mlp->tensor]
      assert tuple(spec) == (None, "fsdp", "tensor"), spec


def test_rules_map_logical_names():
  fsdp_tp = dict(parallel.RULES["fsdp_tp"])
  assert fsdp_tp["embed"] == "fsdp" and fsdp_tp["mlp"] == "tensor" and fsdp_tp["heads"] == "tensor"
  assert "embed" not in dict(parallel.RULES["dp"])


def test_mesh_fills_minus_one():
  cfg = tiny_config(mesh=dict(data=-1, fsdp=2, tensor=2))
  mesh = parallel.make_mesh(cfg.mesh)
  assert dict(mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "fsdp": 2, "expert": 1,
                              "context": 1, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("rules", parallel.RULES)
def test_stacked_layers_go_to_stage(rules):
  """The stacked layers' leading axis lies on the pipeline's stage axis in every preset when the
  mesh has stages; without them no spec names `stage`."""
  staged = parallel.make_mesh(tiny_config(mesh=dict(stage=2, data=-1)).mesh)
  plain = parallel.make_mesh(tiny_config(mesh=dict(data=-1)).mesh)
  with nn.logical_axis_rules(parallel.mesh.rules(staged, rules)):
    assert nn.logical_to_mesh_axes(("layers", "embed", "mlp"))[0] == "stage"
  with nn.logical_axis_rules(parallel.mesh.rules(plain, rules)):
    assert nn.logical_to_mesh_axes(("layers", "embed", "mlp"))[0] is None


@pytest.mark.parametrize("rules", parallel.RULES)
def test_seq_goes_to_context_and_batch_keeps_the_data_axes(rules):
  """Flax takes rules in order and skips a mesh axis a dimension already holds: an activation puts `context` on
  seq, the data axes on batch; an array without seq puts `context` on its batch as well."""
  with nn.logical_axis_rules(parallel.RULES[rules]):
    batch, seq, _ = nn.logical_to_mesh_axes(("batch", "seq", "embed"))
    (alone,) = nn.logical_to_mesh_axes(("batch",))
  assert seq == "context" and tuple(batch) == parallel.DATA_AXES
  assert tuple(alone) == (*parallel.DATA_AXES, "context")
