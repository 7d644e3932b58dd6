"""Mixture-of-Experts SwiGLU feed-forward: top-k routing, dropless or capacity dispatch, expert parallelism.

Sparsely-gated MoE (Shazeer et al., 2017); capacity, priority and the load-balancing loss of GShard
(Lepikhin et al., 2020) and Switch (Fedus et al., 2021); router z-loss of ST-MoE (Zoph et al., 2022);
dropless grouped matmuls of MegaBlocks (Gale et al., 2022); sigmoid routing, shared experts and the
auxiliary-loss-free expert bias of DeepSeek-V3 (2024).

Sharding. With a mesh set, routing and dispatch run in jax.shard_map, manual over the mesh axes that
the active rules give logical `batch` (tensor and any other axis stay automatic), so every sort, top-k,
gather and grouped matmul works on one device's tokens. Manual over the expert axis alone was measured
worse: XLA's SPMD partitioner replicated top_k and every all-to-all operand over the data axes
(all-gathers of all token buffers), so each data shard dispatched every shard's tokens. The weights
enter with only their expert axis manual: each device gathers its E/X experts over fsdp at the boundary
(as GSPMD does for a dense layer), and their gradients are summed over the data axes inside, in param
dtype. A batch that the batch axes do not divide (decoding one sequence) runs without shard_map and
lets GSPMD place everything.
Expert parallelism (logical `expert` on a mesh axis of size X > 1, which must also split the batch)
exchanges tokens with all_to_all over that axis:
  capacity: the [E, C, D] buffers of every row; each shard gets [X, E/X, C, D] per row.
  dropless: every token once to every shard (deduplicated: one row per token and shard however many of
    its k experts live there) with its local expert ids and gates, then ragged_dot on what arrived and
    the gated sums sent back and added up at the source. The buffer is the worst case, X * S rows for S
    local tokens (X / k times the k * S assignment rows; it equals an all-gather of the tokens), because
    XLA:CPU does not implement ragged-all-to-all ("HLO opcode `ragged-all-to-all` is not supported by
    XLA:CPU ThunkEmitter", jax 0.10.2).
Speed: XLA:CPU lowers ragged_dot to a dense masked matmul over all groups (E x the FLOPs of the real
rows), and on an H200 (jax 0.11.2) it ran at 78 TFLOP/s with 8 groups and 9 with 64, where a batched
einsum of the same shapes ran at ~400. So capacity dispatch is the fast one on CPU and GPU (TPU lowers
ragged_dot natively); a grouped-matmul kernel would plug in at `_grouped_swiglu`.

Extra shape letters here: k routing choices, A = k * S assignments of S tokens, M grouped-matmul rows,
R rows (sequences), Q = E * C buffer slots of a row, X expert shards.
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.model import axes
from jaxtrain.model.layers import param
from jaxtrain.model.mlp import Mlp


def route(logits_SE, bias_E, cfg):
  """Top-k routing shared by both dispatch modes -> (experts [..., k] int32, gates [..., k], probs [..., E]).

  Selection uses scores + bias (the bias never reaches the gates, DeepSeek-V3); gates are the scores
  of the selected experts, renormalized to sum 1 if cfg.renormalize, times cfg.route_scale. `probs` is
  the token's normalized routing distribution (softmax, or sigmoid scores divided by their sum).
  """
  logits_SE = logits_SE.astype(jnp.float32)
  if cfg.router == "softmax":
    scores_SE = probs_SE = jax.nn.softmax(logits_SE, axis=-1)
  elif cfg.router == "sigmoid":
    scores_SE = jax.nn.sigmoid(logits_SE)
    probs_SE = scores_SE / jnp.sum(scores_SE, axis=-1, keepdims=True)
  else:
    raise ValueError(f"unknown router {cfg.router!r}")
  _, experts_Sk = jax.lax.top_k(jax.lax.stop_gradient(scores_SE + bias_E), cfg.top_k)
  gates_Sk = jnp.take_along_axis(scores_SE, experts_Sk, axis=-1)
  if cfg.renormalize:
    gates_Sk = gates_Sk / jnp.sum(gates_Sk, axis=-1, keepdims=True)
  return experts_Sk, gates_Sk * cfg.route_scale, probs_SE


def _stat_sums(logits_SE, experts_Sk, probs_SE, valid_S, n_experts):
  """Sums over this shard's valid tokens; psum them across shards, then `_finish_stats`."""
  lead = tuple(range(valid_S.ndim))
  total = lambda t: jnp.sum(jnp.where(valid_S.reshape(valid_S.shape + (1,) * (t.ndim - valid_S.ndim)), t, 0),
                            axis=lead)
  entropy_S = jnp.sum(jax.scipy.special.entr(jax.lax.stop_gradient(probs_SE)), axis=-1)
  counts_SE = jnp.sum(jax.nn.one_hot(experts_Sk, n_experts, dtype=jnp.float32), axis=-2)
  return dict(tokens=jnp.sum(valid_S.astype(jnp.float32)), counts=total(counts_SE), prob_sum=total(probs_SE),
              z=total(jax.nn.logsumexp(logits_SE, axis=-1) ** 2), entropy=total(entropy_S),
              dropped=jnp.zeros((), jnp.float32))


def _finish_stats(sums, cfg):
  tokens = jnp.maximum(sums["tokens"], 1.0)
  load_E = sums["counts"] / (tokens * cfg.top_k)
  return dict(aux_loss=cfg.n_experts * jnp.sum(load_E * sums["prob_sum"] / tokens),
              z_loss=sums["z"] / tokens, load=load_E, dropped=sums["dropped"] / (tokens * cfg.top_k),
              entropy=sums["entropy"] / tokens)


def _sort_by_expert(experts_GA, n_groups):
  """Stable sort of each group's assignments by expert id (id n_groups = not here, sorts last).

  -> order_GA (sorted position -> assignment), inverse_GA (assignment -> sorted position),
  sizes_GE (assignments per expert, int32), rank_GA (position of an assignment within its expert).
  """
  order_GA = jnp.argsort(experts_GA, axis=-1, stable=True)
  iota_A = jnp.arange(experts_GA.shape[-1], dtype=jnp.int32)
  scatter = jax.vmap(lambda dest, value: jnp.zeros_like(value).at[dest].set(value))
  inverse_GA = scatter(order_GA, jnp.broadcast_to(iota_A, order_GA.shape))
  sizes_GE = jax.vmap(lambda e: jnp.bincount(e, length=n_groups + 1))(experts_GA).astype(jnp.int32)
  starts_GE = jnp.cumsum(sizes_GE, axis=-1) - sizes_GE
  rank_GA = inverse_GA - jnp.take_along_axis(starts_GE, experts_GA, axis=-1)
  return order_GA, inverse_GA, sizes_GE[:, :n_groups], rank_GA


def _grouped_swiglu(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
  """SwiGLU of each row with its expert's weights; rows are sorted by expert (jax.lax.ragged_dot)."""
  h_MF = (jax.nn.silu(jax.lax.ragged_dot(x_MD, w_gate_EDF, sizes_E))
          * jax.lax.ragged_dot(x_MD, w_up_EDF, sizes_E))
  return jax.lax.ragged_dot(h_MF, w_down_EFD, sizes_E)


def _dropless(x_SD, experts_Sk, gates_Sk, weights, n_experts, max_rows):
  """Sum over k of gate * expert(x) for each token; ids >= n_experts contribute nothing.

  Assignments are sorted by expert (MegaBlocks) and the first `max_rows` of them (an upper bound on
  the real ones) go through one grouped matmul; nothing is padded to a capacity, nothing dropped.
  """
  s, d = x_SD.shape
  experts_A, gates_A = experts_Sk.T.reshape(-1), gates_Sk.T.reshape(-1)  # assignment a = j * S + s
  order_A, inverse_A, sizes_E, _ = (t[0] for t in _sort_by_expert(experts_A[None], n_experts))
  out_MD = _grouped_swiglu(x_SD[order_A[:max_rows] % s], sizes_E, *weights)
  out_AD = out_MD[jnp.minimum(inverse_A, max_rows - 1)]
  real_A = experts_A < n_experts  # rows past the groups are undefined in ragged_dot: mask, not multiply
  y_AD = jnp.where(real_A[:, None], gates_A[:, None] * out_AD.astype(jnp.float32), 0.0)
  return jnp.sum(y_AD.reshape(-1, s, d), axis=0)


def capacity_slots(experts_RLk, valid_RL, n_experts, capacity_factor):
  """Buffer slot of every assignment under the capacity rule -> (slot_RA, keep_RA, slots per expert).

  A group is one row (sequence) of L tokens. Its capacity is C_row = ceil(capacity_factor * T * k / E)
  with T the row's valid tokens (computed in float32); buffers hold C = ceil(capacity_factor * L * k / E)
  >= C_row slots per expert. Priority (GShard/Switch): every first choice before any second choice,
  and so on; within one choice, tokens in order. An expert keeps its first C_row assignments and drops
  the rest. Assignment a = j * L + l (choice j of token l); slot = expert * C + position, or E * C
  when dropped or padding.
  """
  r, l, k = experts_RLk.shape
  slots = math.ceil(capacity_factor * l * k / n_experts)
  experts_RA = jnp.swapaxes(jnp.where(valid_RL[..., None], experts_RLk, n_experts), 1, 2).reshape(r, -1)
  _, _, _, rank_RA = _sort_by_expert(experts_RA, n_experts)
  tokens_R = jnp.sum(valid_RL, axis=-1).astype(jnp.float32)
  cap_R = jnp.minimum(jnp.ceil(capacity_factor * tokens_R * k / n_experts).astype(jnp.int32), slots)
  keep_RA = (experts_RA < n_experts) & (rank_RA < cap_R[:, None])
  return jnp.where(keep_RA, experts_RA * slots + rank_RA, n_experts * slots), keep_RA, slots


def _capacity(x_RLD, experts_RLk, gates_RLk, valid_RL, weights, cfg, exchange):
  """Capacity dispatch: gather into [R, E, C, D] buffers, dense expert matmuls, gather back."""
  r, l, d = x_RLD.shape
  e = cfg.n_experts
  slot_RA, keep_RA, c = capacity_slots(experts_RLk, valid_RL, e, cfg.capacity_factor)
  token_RA = jnp.broadcast_to(jnp.arange(slot_RA.shape[1], dtype=jnp.int32) % l, slot_RA.shape)
  fill = jax.vmap(lambda slot, value: jnp.zeros((e * c + 1,), value.dtype).at[slot].set(value)[:-1])
  token_RQ, filled_RQ = fill(slot_RA, token_RA), fill(slot_RA, keep_RA)
  buf_RQD = jnp.where(filled_RQ[..., None], jnp.take_along_axis(x_RLD, token_RQ[..., None], axis=1), 0)
  w_gate, w_up, w_down = weights
  x_RXECD = exchange(buf_RQD.reshape(r, -1, w_gate.shape[0], c, d), 1)
  h_RXECF = (jax.nn.silu(jnp.einsum("RXECD,EDF->RXECF", x_RXECD, w_gate))
             * jnp.einsum("RXECD,EDF->RXECF", x_RXECD, w_up))
  out_RQD = exchange(jnp.einsum("RXECF,EFD->RXECD", h_RXECF, w_down), 1).reshape(r, e * c, d)
  out_RAD = jnp.take_along_axis(out_RQD, jnp.minimum(slot_RA, e * c - 1)[..., None], axis=1)
  gates_RA = jnp.swapaxes(gates_RLk, 1, 2).reshape(r, -1)
  y_RAD = jnp.where(keep_RA[..., None], gates_RA[..., None] * out_RAD.astype(jnp.float32), 0.0)
  dropped = jnp.sum(valid_RL) * cfg.top_k - jnp.sum(keep_RA)
  return jnp.sum(y_RAD.reshape(r, -1, l, d), axis=1), dropped.astype(jnp.float32)


def _dispatch_dropless(x_SD, experts_Sk, gates_Sk, weights, cfg, exchange, n_shards):
  """Dropless over X expert shards: every token goes once to every shard (worst case, see MoeMlp)."""
  s, d = x_SD.shape
  local = cfg.n_experts // n_shards
  shard_X11 = jnp.arange(n_shards)[:, None, None]
  ids_XSk = jnp.where(experts_Sk // local == shard_X11, experts_Sk % local, local)
  spread = lambda t: jnp.broadcast_to(t, (n_shards,) + t.shape)
  x_XSD, ids_XSk, gates_XSk = (exchange(t, 0) for t in (spread(x_SD), ids_XSk, spread(gates_Sk)))
  flat = lambda t: t.reshape((n_shards * s,) + t.shape[2:])
  max_rows = n_shards * s * min(cfg.top_k, local)
  y_MD = _dropless(flat(x_XSD), flat(ids_XSk), flat(gates_XSk), weights, local, max_rows)
  y_XSD = exchange(y_MD.astype(x_SD.dtype).reshape(n_shards, s, d), 0)
  return jnp.sum(y_XSD.astype(jnp.float32), axis=0)


def _moe(x_BLD, valid_BL, router_DE, bias_E, weights, cfg, expert_axis, n_shards, manual_axes):
  """Routes and dispatches this shard's tokens; psums the stat sums over `manual_axes`."""
  b, l, d = x_BLD.shape
  e, cd = cfg.n_experts, cfg.compute_dtype
  replicated = tuple(a for a in manual_axes if a != expert_axis)
  if replicated:  # vary before the cast: gradients are then summed across shards in param dtype (and
    # XLA:CPU 0.10.2 crashes on bf16 all-reduces: "Invalid binary instruction opcode copy")
    weights = tuple(jax.lax.pcast(w, replicated, to="varying") for w in weights)
  weights = tuple(w.astype(cd) for w in weights)
  logits_BLE = jnp.einsum("BLD,DE->BLE", x_BLD.astype(jnp.float32), router_DE.astype(jnp.float32))
  experts_BLk, gates_BLk, probs_BLE = route(logits_BLE, bias_E, cfg)
  sums = _stat_sums(logits_BLE, experts_BLk, probs_BLE, valid_BL, e)
  experts_BLk = jnp.where(valid_BL[..., None], experts_BLk, e)  # padding: dispatched nowhere
  x_BLD = x_BLD.astype(cd)
  if expert_axis is None:
    exchange = lambda t, axis: t
  else:  # along `axis` of size X: slice x goes to shard x, and what arrives from shard x lands in slice x
    exchange = lambda t, axis: jax.lax.all_to_all(t, expert_axis, axis, axis)
  if cfg.dispatch == "dropless":
    tokens = lambda t: t.reshape((b * l,) + t.shape[2:])
    y = _dispatch_dropless(tokens(x_BLD), tokens(experts_BLk), tokens(gates_BLk), weights, cfg, exchange,
                           n_shards)
  elif cfg.dispatch == "capacity":
    y, sums["dropped"] = _capacity(x_BLD, experts_BLk, gates_BLk, valid_BL, weights, cfg, exchange)
  else:
    raise ValueError(f"unknown dispatch {cfg.dispatch!r}")
  if manual_axes:
    sums = jax.lax.psum(sums, manual_axes)
  return y.reshape(b, l, d), sums


def _mesh_axes(logical):
  """Mesh axes that `logical` maps to under the active rules, as a tuple."""
  spec = nn.logical_to_mesh_axes((logical,))[0]
  return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def _layout(batch):
  """(batch mesh axes to run manual over, expert mesh axis or None, expert shards), from the active
  logical-axis rules and mesh; axes of size 1 and axes already manual are left out."""
  mesh = jax.sharding.get_abstract_mesh()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  usable = lambda a: mesh.shape.get(a, 1) > 1 and types[a] != jax.sharding.AxisType.Manual
  batch_axes = tuple(a for a in _mesh_axes(axes.BATCH) if usable(a))
  if batch % math.prod(mesh.shape[a] for a in batch_axes):
    return (), None, 1
  expert_axes = [a for a in _mesh_axes(axes.EXPERT) if usable(a)]
  if len(expert_axes) > 1:
    raise ValueError(f"MoeMlp: logical 'expert' must map to one mesh axis, got {expert_axes}")
  if not expert_axes:
    return batch_axes, None, 1
  if expert_axes[0] not in batch_axes:
    raise ValueError(f"MoeMlp: expert parallelism needs the batch split over the expert mesh axis "
                     f"{expert_axes[0]!r} too (as in the fsdp_ep and fsdp_tp_ep rules)")
  return batch_axes, expert_axes[0], mesh.shape[expert_axes[0]]


class MoeMlp(nn.Module):
  """Routed SwiGLU experts (+ optional shared experts): x [B, L, D] -> (y [B, L, D], float32 stats).

  Stats over valid tokens (valid_BL, None = all): aux_loss (E * sum_e f_e P_e), z_loss (mean
  logsumexp(logits)^2), load ([E] assignment fractions before capacity drops), dropped (fraction of
  assignments dropped), entropy (mean entropy of the normalized routing distribution). Padding tokens
  get zero routed output and are not dispatched or counted. Capacity groups and priority: see
  `capacity_slots`. Reads the `moe_state` collection (expert_bias) when cfg.bias_update_rate > 0;
  never writes it.
  """
  cfg: "ModelConfig"  # noqa: F821 (jaxtrain.model.transformer.ModelConfig)

  @nn.compact
  def __call__(self, x_BLD, valid_BL=None):
    c = self.cfg
    e, d, f = c.n_experts, c.d_model, c.expert_d_ff
    out_std = c.init_std / (2 * c.n_layers) ** 0.5
    router_DE = param(self, "router", (d, e), (axes.EMBED, None), c.param_dtype, c.init_std)
    w_gate = param(self, "gate", (e, d, f), (axes.EXPERT, axes.EMBED, axes.MLP), c.param_dtype, c.init_std)
    w_up = param(self, "up", (e, d, f), (axes.EXPERT, axes.EMBED, axes.MLP), c.param_dtype, c.init_std)
    w_down = param(self, "down", (e, f, d), (axes.EXPERT, axes.MLP, axes.EMBED), c.param_dtype, out_std)
    bias_E = jnp.zeros((e,), jnp.float32)
    if c.bias_update_rate > 0:
      init = nn.with_logical_partitioning(lambda: jnp.zeros((e,), jnp.float32), (None,))
      bias_E = self.variable("moe_state", "expert_bias", init).value
    b, l, _ = x_BLD.shape
    valid_BL = jnp.ones((b, l), bool) if valid_BL is None else valid_BL.astype(bool)
    batch_axes, expert_axis, n_shards = _layout(b)
    if e % n_shards:
      raise ValueError(f"MoeMlp: {e} experts do not split over {n_shards} expert shards")
    moe = functools.partial(_moe, cfg=c, expert_axis=expert_axis, n_shards=n_shards, manual_axes=batch_axes)
    if batch_axes:
      moe = jax.shard_map(moe, mesh=jax.sharding.get_abstract_mesh(), axis_names=set(batch_axes),
                          in_specs=(P(batch_axes), P(batch_axes), P(), P(), P(expert_axis)),
                          out_specs=(P(batch_axes), P()))
    y_BLD, sums = moe(x_BLD, valid_BL, router_DE, jax.lax.stop_gradient(bias_E), (w_gate, w_up, w_down))
    if c.n_shared_experts:
      shared = dataclasses.replace(c, d_ff=c.n_shared_experts * f)
      y_BLD = y_BLD + Mlp(shared, name="shared")(x_BLD).astype(jnp.float32)
    return y_BLD.astype(c.compute_dtype), _finish_stats(sums, c)
