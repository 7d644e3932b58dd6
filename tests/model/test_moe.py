"""MoeMlp: routing, dropless and capacity dispatch against a plain per-token reference; EP == unsharded."""

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import parallel
from jaxtrain.model.mlp import Mlp
from jaxtrain.model.moe import MoeMlp
from jaxtrain.model.moe_layout import capacity_slots, tile_layout
from jaxtrain.model.transformer import ModelConfig
from tests.fixtures import tiny_config

BASE = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=8, d_ff=24,
                   max_seq_len=16, n_experts=8, top_k=2, init_std=0.5)


def make(cfg, batch=2, length=8, pad=True, seed=0, bias_scale=0.0):
  """Variables (numpy normal(init_std) in the module's shapes; a random expert bias when enabled), x,
  a valid mask and an output cotangent. numpy, so that making data compiles nothing."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, std=1.0: jnp.asarray(std * rng.standard_normal(shape), jnp.float32)
  x = normal((batch, length, cfg.d_model))
  shapes = nn.unbox(jax.eval_shape(MoeMlp(cfg).init, jax.random.key(0), x))
  variables = jax.tree.map(lambda s: normal(s.shape, cfg.init_std), shapes)
  if "moe_state" in variables:
    variables["moe_state"]["expert_bias"] = normal((cfg.n_experts,), bias_scale)
  valid = jnp.asarray(rng.uniform(size=(batch, length)) > 0.25 if pad else np.ones((batch, length), bool))
  return variables, x, valid, normal(x.shape)


def loss_fn(cfg):
  """Loss touching every output: <y, ct> + aux + z; returns (loss, (y, stats))."""
  def loss(params, x, valid, ct, state):
    y, stats = MoeMlp(cfg).apply({"params": params, **state}, x, valid)
    return jnp.sum(y * ct) + stats["aux_loss"] + stats["z_loss"], (y, stats)
  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def run(cfg, variables, x, valid, ct):
  state = {k: v for k, v in variables.items() if k != "params"}
  (_, (y, stats)), grads = jax.jit(loss_fn(cfg))(variables["params"], x, valid, ct, state)
  return jax.block_until_ready((y, stats, grads))


# ---- the plain reference: loops over tokens and their selected experts ----

def ref_scores(cfg, logits, xp=jnp):
  return xp.exp(logits - logits.max(-1, keepdims=True)) if cfg.router == "softmax" else 1 / (1 + xp.exp(-logits))


def ref_probs(cfg, variables, x):
  """[B, L, E] normalized routing probabilities and [B, L, k] top-k of scores + bias, in numpy."""
  bias = np.asarray(variables.get("moe_state", {}).get("expert_bias", np.zeros(cfg.n_experts)))
  logits = np.asarray(x, np.float64) @ np.asarray(variables["params"]["router"], np.float64)
  scores = ref_scores(cfg, logits, np)
  scores = scores / scores.sum(-1, keepdims=True) if cfg.router == "softmax" else scores
  selected = np.argsort(-(scores + bias), axis=-1, kind="stable")[..., : cfg.top_k]
  return scores / scores.sum(-1, keepdims=True), selected


def ref_select(cfg, variables, x):
  return ref_probs(cfg, variables, x)[1]


def ref_keep(selected, valid, n_experts, factor):
  """Capacity drops by the priority rule: per row, all first choices in token order, then seconds..."""
  keep = np.zeros(selected.shape, bool)
  for b in range(selected.shape[0]):
    cap = math.ceil(np.float32(factor) * np.float32(valid[b].sum()) * selected.shape[2] / n_experts)
    taken = np.zeros(n_experts, int)
    for j in range(selected.shape[2]):
      for t in range(selected.shape[1]):
        if valid[b, t]:
          keep[b, t, j] = taken[selected[b, t, j]] < cap
          taken[selected[b, t, j]] += 1
  return keep


def ref_token(cfg, params, x_D, ct_D, selected, keep, load, weight):
  """One token: (<y, ct> + its share of aux + z, y), looping over its selected experts.

  aux = E * sum_e load_e * mean_t(p_te) is a sum over tokens once `load` (constant) is known, so the
  loss splits token by token; `weight` is 1 / valid tokens (0 for padding).
  """
  logits = x_D @ params["router"]
  scores = ref_scores(cfg, logits)
  scores = scores / jnp.sum(scores) if cfg.router == "softmax" else scores
  gates = jnp.stack([scores[e] for e in selected])
  gates = (gates / jnp.sum(gates) if cfg.renormalize else gates) * cfg.route_scale
  y = jnp.zeros_like(x_D)
  for j in range(cfg.top_k):
    e = selected[j]
    h = jax.nn.silu(x_D @ params["gate"][e]) * (x_D @ params["up"][e])
    y = y + jnp.where(keep[j], gates[j] * (h @ params["down"][e]), 0.0)
  if cfg.n_shared_experts:
    shared = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.expert_d_ff)
    y = y + Mlp(shared).apply({"params": params["shared"]}, x_D[None, None])[0, 0]
  aux = cfg.n_experts * jnp.sum(load * scores / jnp.sum(scores))
  return jnp.sum(y * ct_D) + weight * (aux + jax.nn.logsumexp(logits) ** 2), y


_ref_token_grad = jax.jit(jax.value_and_grad(ref_token, argnums=(1, 2), has_aux=True), static_argnums=0)


def ref_forward(cfg, params, x, ct, valid, selected, keep):
  """Loss <y, ct> + aux + z, y, and their gradients w.r.t. (params, x), token by token."""
  tokens = int(valid.sum())
  load = np.bincount(selected[valid].ravel(), minlength=cfg.n_experts) / (tokens * cfg.top_k)
  cfg = dataclasses.replace(cfg, dispatch="dropless", capacity_factor=1.0)  # one compile per routing
  total, ys, dxs, dparams = 0.0, [], [], None
  for b, t in np.ndindex(valid.shape):
    (loss, y), (dp, dx) = _ref_token_grad(cfg, params, x[b, t], ct[b, t], selected[b, t],
                                          keep[b, t] & valid[b, t], load, valid[b, t] / tokens)
    total, dparams = total + loss, dp if dparams is None else jax.tree.map(jnp.add, dparams, dp)
    ys.append(y), dxs.append(dx)
  return total, jnp.stack(ys).reshape(x.shape), (dparams, jnp.stack(dxs).reshape(x.shape))


def ref_stats(cfg, variables, x, valid, selected, keep):
  """load, dropped and entropy in numpy (aux and z come from ref_forward)."""
  probs = ref_probs(cfg, variables, x)[0][valid]
  n = valid.sum() * cfg.top_k
  return dict(load=np.bincount(selected[valid].ravel(), minlength=cfg.n_experts) / n,
              dropped=(~keep[valid]).sum() / n, entropy=np.mean(-np.sum(probs * np.log(probs), -1)))


def close(actual, desired):
  """float32 equality: relative, plus absolute at the array's scale (entries that are sums of larger
  terms of both signs carry the rounding of those terms; measured ~5e-7 x max against float64)."""
  desired = np.asarray(desired)
  np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=2e-6 * max(np.abs(desired).max(), 1e-3))


def check_against_reference(cfg, variables, x, valid, ct, keep=None):
  """MoeMlp == ref_forward: outputs, stats, and gradients of <y, ct> + aux + z."""
  selected, valid_np = ref_select(cfg, variables, x), np.asarray(valid)
  keep = np.ones(selected.shape, bool) if keep is None else keep
  total, ref_y, ref_grads = ref_forward(cfg, variables["params"], x, ct, valid_np, selected, keep)
  y, stats, grads = run(cfg, variables, x, valid, ct)
  close(y, ref_y)
  close(jnp.sum(y * ct) + stats["aux_loss"] + stats["z_loss"], total)
  for name, value in ref_stats(cfg, variables, x, valid_np, selected, keep).items():
    np.testing.assert_allclose(stats[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
  jax.tree.map(close, grads, ref_grads)
  return selected, stats


# ---- tests ----

def test_one_expert_equals_mlp():
  cfg = dataclasses.replace(BASE, n_experts=1, top_k=1)
  variables, x, _, _ = make(cfg, pad=False)
  y, stats = jax.jit(MoeMlp(cfg).apply)(variables, x)
  p = variables["params"]
  dense = {"gate": p["gate"][0], "up": p["up"][0], "down": p["down"][0]}
  np.testing.assert_allclose(y, Mlp(cfg).apply({"params": dense}, x), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(stats["load"], [1.0])
  np.testing.assert_allclose(stats["aux_loss"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(stats["z_loss"], jnp.mean((x @ p["router"]) ** 2), rtol=1e-5)


@pytest.mark.parametrize("variant", [
    dict(router="softmax"),
    dict(router="sigmoid", renormalize=False, route_scale=2.5, n_shared_experts=1, d_ff_expert=12,
         bias_update_rate=0.01),
    dict(router="sigmoid", bias_update_rate=0.01, grouped_matmul="tiles", skew=("expert_bias",)),
    dict(grouped_matmul="ragged_dot"),
])
def test_dropless_equals_reference(variant):
  cfg = dataclasses.replace(BASE, **{k: v for k, v in variant.items() if k != "skew"})
  variables, x, valid, ct = make(cfg, bias_scale=0.3)
  if "expert_bias" in variant.get("skew", ()):  # most tokens pick experts 0 and 1: each spans several tiles
    variables["moe_state"]["expert_bias"] = jnp.asarray([3.0, 3.0] + [0.0] * (cfg.n_experts - 2))
  selected, _ = check_against_reference(cfg, variables, x, valid, ct)
  if cfg.bias_update_rate:  # the bias really moved the selection (and the reference took gates unbiased)
    unbiased = {"params": variables["params"]}
    assert (np.sort(ref_select(cfg, unbiased, x), -1) != np.sort(selected, -1)).any()


def test_tile_layout_is_a_padded_sort():
  """Every real assignment gets its own row inside its expert's tiles, rows map back, T is a bound."""
  rng = np.random.default_rng(3)
  n_experts, tile = 4, 8
  experts = np.where(rng.uniform(size=60) < 0.2, n_experts, rng.choice(n_experts, 60, p=[0.7, 0.1, 0.1, 0.1]))
  max_rows = int((experts < n_experts).sum())
  t = jax.tree.map(np.asarray, jax.jit(tile_layout, static_argnums=(1, 2, 3))(
      jnp.asarray(experts, jnp.int32), n_experts, max_rows, tile))
  real = np.flatnonzero(experts < n_experts)
  rows = t.row_A[real]
  assert len(set(rows)) == len(rows)
  np.testing.assert_array_equal(t.expert_T[rows // tile], experts[real])  # a row sits in its expert's tile
  np.testing.assert_array_equal(t.source_P[rows], real)
  assert t.filled_P.sum() == len(real) and len(t.filled_P) == (-(-max_rows // tile) + n_experts) * tile
  counts = np.bincount(experts[real], minlength=n_experts)
  assert counts[0] > 2 * tile  # expert 0 really spans several tiles
  np.testing.assert_array_equal(np.bincount(t.expert_T[:(-(-counts // tile)).sum()], minlength=n_experts),
                                -(-counts // tile))


def test_capacity_without_drops_equals_reference():
  cfg = dataclasses.replace(BASE, dispatch="capacity", capacity_factor=BASE.n_experts)  # C >= L * k
  variables, x, valid, ct = make(cfg)
  _, stats = check_against_reference(cfg, variables, x, valid, ct)
  assert stats["dropped"] == 0


def test_capacity_drops_by_priority():
  """Which (token, choice) assignments are dropped follows the documented priority rule exactly."""
  cfg = dataclasses.replace(BASE, dispatch="capacity", capacity_factor=0.75)
  variables, x, valid, ct = make(cfg, batch=3, length=8, seed=1)
  selected = ref_select(cfg, variables, x)
  keep = ref_keep(selected, np.asarray(valid), cfg.n_experts, cfg.capacity_factor)
  slots = jax.jit(capacity_slots, static_argnums=(2, 3))
  keep_RA = slots(jnp.asarray(selected, jnp.int32), valid, cfg.n_experts, cfg.capacity_factor).keep_RA
  np.testing.assert_array_equal(np.swapaxes(np.asarray(keep_RA).reshape(3, cfg.top_k, 8), 1, 2), keep)
  _, stats = check_against_reference(cfg, variables, x, valid, ct, keep)
  assert 0.1 < stats["dropped"] < 0.9  # the rule was exercised both ways


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_padding_is_invisible(dispatch):
  """Padding (with large junk in it) gets zero routed output and leaves the rest, stats included."""
  cfg = dataclasses.replace(BASE, dispatch=dispatch, capacity_factor=0.75)
  variables, x, _, _ = make(cfg, length=8, pad=False)
  valid = jnp.broadcast_to(jnp.arange(8) < 5, (2, 8))
  junk = x.at[:, 5:].set(1e3 * x[:, :3])
  apply = jax.jit(MoeMlp(cfg).apply)
  (y, stats), (ref_y, ref_stats_) = apply(variables, junk, valid), apply(variables, x[:, :5])
  close(y[:, :5], ref_y)
  assert not np.asarray(y[:, 5:]).any()
  jax.tree.map(close, stats, ref_stats_)
  assert dispatch == "dropless" or stats["dropped"] > 0


# ---- expert parallelism ----

EP_CFG = dataclasses.replace(BASE, n_shared_experts=1, bias_update_rate=0.01, capacity_factor=1.0)
EP_MESHES = {"2data_4expert": (dict(data=2, expert=4), "fsdp_ep"),
             "2expert_2fsdp_2tensor": (dict(expert=2, fsdp=2, tensor=2), "fsdp_tp_ep"),
             "2data_4fsdp": (dict(data=2, fsdp=4), "fsdp")}  # no expert axis: dispatch per data shard
EP_CASES = [(m, d) for m in list(EP_MESHES)[:2] for d in ("dropless", "capacity")] + [("2data_4fsdp", "dropless")]


def ep_inputs(cfg):
  return make(cfg, batch=8, length=4, seed=2, bias_scale=0.3)


@functools.cache
def ep_unsharded(dispatch):
  cfg = dataclasses.replace(EP_CFG, dispatch=dispatch)
  return run(cfg, *ep_inputs(cfg))


@functools.cache
def ep_case(mesh_name, dispatch):
  """(unsharded result, sharded result, compiled HLO text, expert weight spec)."""
  sizes, rules = EP_MESHES[mesh_name]
  cfg = dataclasses.replace(EP_CFG, dispatch=dispatch)
  variables, x, valid, ct = ep_inputs(cfg)
  unsharded = ep_unsharded(dispatch)
  mesh = parallel.make_mesh(tiny_config(mesh={"data": 1, **sizes}).mesh, jax.devices())
  specs = nn.get_partition_spec(jax.eval_shape(MoeMlp(cfg).init, jax.random.key(0), x))
  variables = jax.device_put(variables, parallel.logical_shardings(specs, mesh, rules))
  x, valid, ct = jax.device_put((x, valid, ct), NamedSharding(mesh, P(parallel.DATA_AXES)))
  state = {"moe_state": variables["moe_state"]}
  with parallel.activate(mesh, rules):
    compiled = jax.jit(loss_fn(cfg)).lower(variables["params"], x, valid, ct, state).compile()
    (_, (y, stats)), grads = jax.block_until_ready(compiled(variables["params"], x, valid, ct, state))
  return unsharded, (y, stats, grads), compiled.as_text(), variables["params"]["gate"].sharding.spec


@pytest.mark.parametrize("mesh_name,dispatch", EP_CASES)
def test_sharded_equals_unsharded(mesh_name, dispatch):
  unsharded, sharded, _, spec = ep_case(mesh_name, dispatch)
  assert spec[0] == ("expert" if "expert" in mesh_name else None), spec  # the experts really are split
  jax.tree.map(close, jax.device_get(sharded), unsharded)
  assert dispatch == "dropless" or unsharded[1]["dropped"] > 0


def hlo_ops(text, op):
  """Result shapes (tuples of dims, one per array) of every `op` instruction in compiled HLO text."""
  found = []
  for line in text.splitlines():
    m = re.match(rf"\s*(?:ROOT )?%\S+ = (.*?) {op}(?:-start)?\(", line)
    if m:
      found.append([tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", m[1])])
  return found


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_parallel_hlo_moves_tokens_not_weights(dispatch):
  """EP forward + backward: all-to-alls of token-sized buffers, no all-gather of full [E, ...] weights."""
  _, _, text, _ = ep_case("2data_4expert", dispatch)
  c = EP_CFG
  weights = {(c.n_experts, c.d_model, c.expert_d_ff), (c.n_experts, c.expert_d_ff, c.d_model)}
  a2a = [s for shapes in hlo_ops(text, "all-to-all") for s in shapes]
  assert any(s[-1] == c.d_model for s in a2a), a2a  # token rows of width D travel
  tokens_per_device = 8 * 4 // 8
  assert max(math.prod(s) for s in a2a) <= 4 * tokens_per_device * c.d_model, a2a  # X * S rows at most
  gathered = [s for shapes in hlo_ops(text, "all-gather") for s in shapes]
  assert not weights & set(gathered), gathered
