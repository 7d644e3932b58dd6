"""Context parallelism: the load-balancing permutation, attention across sequence shards, and the model's
loss and gradients over a context axis equal to the unsharded model's."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data, parallel
from jaxtrain.kernels.attention import reference
from jaxtrain.model import context
from jaxtrain.parallel import hlo_bytes
from jaxtrain.train import loop, state as state_lib
from jaxtrain.train.step import accumulate_gradients
from tests.fixtures import tiny_config

# f32 sums reassociated across shards (a softmax over gathered keys, gradients reduce-scattered): measured
# relative errors are ~1e-6 (loss) and ~1e-5 (gradients); the tolerances leave a margin of about ten.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-7


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_permute_round_trips_and_balances(c):
  x_BL = np.random.default_rng(c).integers(0, 1000, (3, 32))
  np.testing.assert_array_equal(context.unpermute(context.permute(x_BL, c), c), x_BL)
  x_BLD = np.random.default_rng(c).normal(size=(2, 32, 5))
  np.testing.assert_array_equal(context.permute(x_BLD, c), np.stack([context.permute(x_BLD[..., i], c)
                                                                     for i in range(5)], -1))
  # shard i holds chunks i and 2c-1-i
  chunk = 32 // (2 * c)
  shards_CN = np.asarray(context.permute(np.arange(32)[None], c)).reshape(c, 2 * chunk)
  for i in range(c):
    want = np.concatenate([np.arange(i * chunk, (i + 1) * chunk), np.arange((2 * c - 1 - i) * chunk,
                                                                            (2 * c - i) * chunk)])
    np.testing.assert_array_equal(shards_CN[i], want)


def test_context_attention_of_a_permuted_row_equals_reference():
  """Queries on their shards attend all-gathered keys of a load-balanced row (packed documents, padding)."""
  b, l, h, g, kd, c = 2, 64, 4, 2, 8, 4
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(b, l, n, kd)), jnp.float32) for n in (h, g, g))
  segment_BL = jnp.asarray(np.sort(rng.integers(1, 5, (b, l)), axis=1)).at[1, 50:].set(0)  # padding at the end
  index_BL = jnp.broadcast_to(jnp.arange(l), (b, l))
  want = reference.attention(q, k, v, segment_BL, segment_BL, index_BL, index_BL)
  mesh = parallel.make_mesh(tiny_config(mesh=dict(data=2, context=c)).mesh)
  p = lambda x: context.permute(x, c)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES["fsdp"]):
    assert context.shards() == c
    got = jax.jit(lambda *a: context.context_attention(*a, reference.attention))(
        p(q), p(k), p(v), p(segment_BL), p(segment_BL), p(index_BL), p(index_BL))
  np.testing.assert_allclose(context.unpermute(got, c), want, rtol=1e-5, atol=1e-6)


def setup(mesh_sizes, seq_len, rules="fsdp"):
  cfg = tiny_config(model=dict(n_kv_heads=2, vocab_size=64, max_seq_len=seq_len), mesh=dict(rules=rules))
  cfg.mesh.update({"data": 1, **mesh_sizes})
  cfg.train.update(seq_len=seq_len, batch_size=2, z_loss=1e-4)
  devices = jax.devices()[: int(np.prod(list(mesh_sizes.values())))]
  mesh, task, tx, _ = loop.build(cfg, "", devices)
  state, _ = state_lib.create_state(task, tx, 0, mesh, rules)
  batch = data.make_source(cfg, "train").batch(0, 0, cfg.train.batch_size)
  batch["segment_ids"][1, -seq_len // 3:] = 0  # padding across several chunks of row 1
  batch["loss_mask"][1, -seq_len // 3:] = 0
  assert len(np.unique(batch["segment_ids"][0])) > 4  # several packed documents per row
  batch = parallel.Feed(cfg.train.batch_size, parallel.batch_sharding(mesh)).put(batch)
  grads_fn = jax.jit(lambda s, b: accumulate_gradients(task.loss, s, b, 1))
  return mesh, rules, grads_fn, state, batch


def loss_and_grads(mesh_sizes, seq_len):
  mesh, rules, grads_fn, state, batch = setup(mesh_sizes, seq_len)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES[rules]):
    grads, sums = grads_fn(state, batch)
  return float(sums["ce"] / sums["count"]), jax.device_get(jax.tree.map(lambda g: g / sums["count"], grads))


def check_equal(seq_len):
  ref_loss, ref_grads = loss_and_grads(dict(data=1), seq_len)
  for sizes in (dict(data=2, context=4), dict(context=8)):
    loss, grads = loss_and_grads(sizes, seq_len)
    print(f"{sizes} L={seq_len}: loss rel err {abs(loss - ref_loss) / abs(ref_loss):.2e}, grad max rel err "
          f"{max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b))), grads, ref_grads))):.2e}")
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL, err_msg=str(sizes))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=str(sizes)),
                 grads, ref_grads)


def test_context_parallel_equals_unsharded():
  check_equal(256)


@pytest.mark.slow
def test_context_parallel_equals_unsharded_2k():
  check_equal(2048)


def test_step_gathers_keys_and_values_not_activations():
  """Compiled HLO over 8 context shards: K and V [B, L, G, K] (and their int32 ids) are all-gathered over
  `context` in every layer; nothing [B, L, D] at full length is."""
  l, d = 256, 32
  mesh, rules, grads_fn, state, batch = setup(dict(context=8), l)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES[rules]):
    hlo = grads_fn.lower(state, batch).compile().as_text()
  gathers = [r for r in hlo_bytes.collectives(hlo, mesh) if r.kind == "all-gather"]
  kv_bytes = 2 * l * 2 * 8 * 4  # one K or V: [B=2, L, G=2, K=8] float32
  kv = [r for r in gathers if r.axes == ("context",) and r.result_bytes == kv_bytes]
  assert sum(r.runs for r in kv) == 2 * 2, [(r.name, r.axes, r.result_bytes, r.runs) for r in gathers]  # K, V x 2 layers
  assert all(r.axes == ("context",) for r in gathers), [(r.name, r.axes) for r in gathers]
  assert not [r for r in gathers if r.result_bytes >= 2 * l * d * 4], [(r.name, r.result_bytes) for r in gathers]
  shapes = [line for line in hlo.splitlines() if "all-gather" in line and f",{l},{d}]" in line.split("=")[0]]
  assert not shapes, shapes
