"""Mixture-of-Experts SwiGLU feed-forward: top-k routing, dropless or capacity dispatch, expert
parallelism.

Sparsely-gated MoE (Shazeer et al., 2017); capacity, priority and the load-balancing loss of GShard
(Lepikhin et al., 2020) and Switch (Fedus et al., 2021); router z-loss of ST-MoE (Zoph et al.,
2022); dropless grouped matmuls of MegaBlocks (Gale et al., 2022); sigmoid routing, shared experts
and the auxiliary-loss-free expert bias of DeepSeek-V3 (2024).

Sharding. With a mesh set, routing and dispatch run in jax.shard_map, manual over the mesh axes that
the active rules give logical `batch` (tensor and any other axis stay automatic), so every sort,
top-k, gather and grouped matmul works on one device's tokens. Manual over the expert axis alone was
measured worse: XLA's SPMD partitioner replicated top_k and every all-to-all operand over the data
axes (all-gathers of all token buffers), so each data shard dispatched every shard's tokens. The
weights enter with only their expert axis manual: each device gathers its E/X experts over fsdp at
the boundary (as GSPMD does for a dense layer), and their gradients are summed over the data axes
inside, in param dtype. A batch that the batch axes do not divide (decoding one sequence) runs
without shard_map and lets GSPMD place everything.
Expert parallelism (logical `expert` on a mesh axis of size X > 1, which must also split the batch)
exchanges tokens with all_to_all over that axis:
  capacity: the expert-major [E, R, C, D] buffers; each shard gets [X, E/X, R * C, D].
  dropless: every token once to every shard (deduplicated: one row per token and shard however many
    of its k experts live there) with its local expert ids and gates, then the grouped matmul on
    what arrived and the gated sums sent back and added up at the source. The buffer is the worst
    case, X * N rows for N local tokens (X / k times the k * N assignment rows; it equals an
    all-gather of the tokens), because XLA:CPU does not implement ragged-all-to-all ("HLO opcode
    `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter", jax 0.10.2).
Speed. Dispatch and combine are row gathers whose transposes are gathers too (moe_layout.py; XLA
would transpose them to scatter-adds). Expert matmuls are dense batched [E, M, D] einsums (capacity)
or the same over tiles of one expert's rows with each tile's weights gathered (dropless "tiles", the
block-sparse form of MegaBlocks in plain XLA; the default off TPU). jax.lax.ragged_dot is the other
dropless grouped matmul ("ragged_dot", the default on TPU, which lowers it natively): XLA:CPU lowers
it to a dense masked matmul over all groups (E x the FLOPs of the real rows), and on an H200 too the
fine-grained step with it is slower than with tiles. Tiles pay for gathering T x 3 x D x F weights:
when D x F is large that dominates (dropless then costs a multiple of the capacity step on an H200),
and larger tiles for large D x F are the next lever there. benchmarks/moe.py measures them side by
side; the figures are in benchmarks/RESULTS.md ("MoE dispatch for fine-grained experts").

Shape letters: see jaxtrain/model/axes.py.
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.kernels import platform
from jaxtrain import collectives
from jaxtrain.model import axes, fp8, pipeline
from jaxtrain.model.layers import param
from jaxtrain.model.mlp import Mlp
from jaxtrain.model.moe_layout import (capacity_slots, combine, sort_by_expert, take, tile_layout,
                                       tile_size)


def route(logits_NE, bias_E, cfg):
  """Top-k routing shared by both dispatch modes -> (experts [..., k] int32, gates [..., k], probs
  [..., E]).

  Selection uses scores + bias (the bias never reaches the gates, DeepSeek-V3); gates are the scores
  of the selected experts, renormalized to sum 1 if cfg.renormalize, times cfg.route_scale. `probs`
  is the token's normalized routing distribution (softmax, or sigmoid scores divided by their sum).
  """
  logits_NE = logits_NE.astype(jnp.float32)
  if cfg.router == "softmax":
    scores_NE = probs_NE = jax.nn.softmax(logits_NE, axis=-1)
  elif cfg.router == "sigmoid":
    scores_NE = jax.nn.sigmoid(logits_NE)
    probs_NE = scores_NE / jnp.sum(scores_NE, axis=-1, keepdims=True)
  else:
    raise ValueError(f"unknown router {cfg.router!r}")
  _, experts_Nk = jax.lax.top_k(jax.lax.stop_gradient(scores_NE + bias_E), cfg.top_k)
  gates_Nk = jnp.take_along_axis(scores_NE, experts_Nk, axis=-1)
  if cfg.renormalize:
    gates_Nk = gates_Nk / jnp.sum(gates_Nk, axis=-1, keepdims=True)
  return experts_Nk, gates_Nk * cfg.route_scale, probs_NE


def _stat_sums(logits_NE, experts_Nk, probs_NE, valid_N, n_experts):
  """Sums over this shard's valid tokens; psum them across shards, then `finish_stats`."""
  lead = tuple(range(valid_N.ndim))
  total = lambda t: jnp.sum(
      jnp.where(valid_N.reshape(valid_N.shape + (1,) * (t.ndim - valid_N.ndim)), t, 0), axis=lead)
  entropy_N = jnp.sum(jax.scipy.special.entr(jax.lax.stop_gradient(probs_NE)), axis=-1)
  counts_NE = jnp.sum(jax.nn.one_hot(experts_Nk, n_experts, dtype=jnp.float32), axis=-2)
  return dict(tokens=jnp.sum(valid_N.astype(jnp.float32)), counts=total(counts_NE),
              prob_sum=total(probs_NE), z=total(jax.nn.logsumexp(logits_NE, axis=-1) ** 2),
              entropy=total(entropy_N), dropped=jnp.zeros((), jnp.float32))


def finish_stats(sums, cfg):
  """The stats of MoeMlp from their sums over tokens (a pipeline adds up its microbatches' sums
  first: the stats of the whole batch, not a mean of the microbatches')."""
  tokens = jnp.maximum(sums["tokens"], 1.0)
  load_E = sums["counts"] / (tokens * cfg.top_k)
  return dict(aux_loss=cfg.n_experts * jnp.sum(load_E * sums["prob_sum"] / tokens),
              z_loss=sums["z"] / tokens, load=load_E,
              dropped=sums["dropped"] / (tokens * cfg.top_k), entropy=sums["entropy"] / tokens)


def _grouped_swiglu(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, mode="off"):
  """SwiGLU of each row with its expert's weights; rows are sorted by expert (jax.lax.ragged_dot).
  `mode`: model.fp8 (fp8.ragged_dot)."""
  h_MF = (jax.nn.silu(fp8.ragged_dot(x_MD, w_gate_EDF, sizes_E, mode))
          * fp8.ragged_dot(x_MD, w_up_EDF, sizes_E, mode))
  return fp8.ragged_dot(h_MF, w_down_EFD, sizes_E, mode)


def _expert_swiglu(x_EMD, w_gate_EDF, w_up_EDF, w_down_EFD, mode="off"):
  """SwiGLU of every expert's M buffer rows: dense batched matmuls (`mode`: model.fp8,
  fp8.einsum)."""
  h_EMF = (jax.nn.silu(fp8.einsum("EMD,EDF->EMF", x_EMD, w_gate_EDF, mode))
           * fp8.einsum("EMD,EDF->EMF", x_EMD, w_up_EDF, mode))
  return fp8.einsum("EMF,EFD->EMD", h_EMF, w_down_EFD, mode)


def _dropless(x_ND, experts_Nk, gates_Nk, weights, n_experts, max_rows, grouped_matmul, mode="off"):
  """Sum over k of gate * expert(x) for each token; ids >= n_experts contribute nothing.

  Assignments (a = token * k + j) are sorted by expert (MegaBlocks); `max_rows` bounds the real
  ones. Nothing is dropped. grouped_matmul "tiles": each expert's rows padded to whole tiles, one
  batched matmul over tiles with each tile's expert weights gathered (MegaBlocks' block-sparse form,
  in plain XLA); "ragged_dot": the first max_rows sorted rows through jax.lax.ragged_dot (native on
  TPU; XLA:CPU runs it as a dense matmul over every group). Gathers both ways go through `take`.
  `mode`: model.fp8 for the expert matmuls.
  """
  n, d = x_ND.shape
  k = experts_Nk.shape[1]
  experts_A = experts_Nk.reshape(-1)
  real_A = experts_A < n_experts
  per_token = lambda t: t.reshape(n, k)
  if grouped_matmul == "tiles":
    t = tile_layout(experts_A, n_experts, max_rows, tile_size(max_rows, n_experts))
    x_PD = take(x_ND, (t.source_P // k)[:, None], t.filled_P[:, None], per_token(t.row_A),
                per_token(real_A))
    weights_T = tuple(jnp.take(w, t.expert_T, axis=0) for w in weights)
    out_PD = _expert_swiglu(x_PD.reshape(-1, t.tile, d), *weights_T, mode=mode).reshape(-1, d)
    return combine(out_PD, gates_Nk, per_token(t.row_A), per_token(real_A), t.source_P, t.filled_P)
  if grouped_matmul == "ragged_dot":
    order_A, inverse_A, sizes_E, _ = (t[0] for t in sort_by_expert(experts_A[None], n_experts))
    # rows past the groups are undefined in ragged_dot
    filled_M = jnp.arange(max_rows) < jnp.sum(sizes_E)
    order_M = order_A[:max_rows]
    x_MD = take(x_ND, (order_M // k)[:, None], filled_M[:, None], per_token(inverse_A),
                per_token(real_A))
    out_MD = _grouped_swiglu(x_MD, sizes_E, *weights, mode=mode)
    return combine(out_MD, gates_Nk, per_token(inverse_A), per_token(real_A), order_M, filled_M)
  raise ValueError(f"unknown grouped_matmul {grouped_matmul!r}")


def _capacity(x_RLD, experts_RLk, gates_RLk, valid_RL, weights, cfg, exchange):
  """Capacity dispatch: gather tokens into expert-major [E, R, C, D] buffers, dense expert matmuls,
  gather each token's k results back and sum them with the gates."""
  r, l, d = x_RLD.shape
  e, k = cfg.n_experts, cfg.top_k
  s = capacity_slots(experts_RLk, valid_RL, e, cfg.capacity_factor)
  a = l * k
  per_token = lambda t: jnp.swapaxes(t.reshape(r, k, l), 1, 2).reshape(r * l, k)  # [R, A] -> [N, k]
  slot_Nk, keep_Nk = per_token(s.slot_RA), per_token(s.keep_RA)
  token_Q = s.source_Q // a * l + s.source_Q % l  # the token (of R * L) a slot holds
  pair_Q = token_Q * k + s.source_Q % a // l  # its (token, choice) pair, flat N * k
  buf_QD = take(x_RLD.reshape(r * l, d), token_Q[:, None], s.filled_Q[:, None], slot_Nk, keep_Nk)
  local = weights[0].shape[0]  # E / X experts on this shard
  x_XEMD = exchange(buf_QD.reshape(-1, local, r * s.capacity, d), 0)
  n_shards = x_XEMD.shape[0]
  # one [E, M, D] batched matmul: XLA:CPU ran the same einsum over [X, E, R, C, D] slower
  # (benchmarks/RESULTS.md)
  x_EMD = jnp.swapaxes(x_XEMD, 0, 1).reshape(local, n_shards * r * s.capacity, d)
  out_EMD = _expert_swiglu(x_EMD, *weights, mode=cfg.fp8)
  out_XEMD = jnp.swapaxes(out_EMD.reshape(local, n_shards, r * s.capacity, d), 0, 1)
  out_QD = exchange(out_XEMD, 0).reshape(-1, d)
  gates_Nk = per_token(jnp.swapaxes(gates_RLk, 1, 2).reshape(r, a))
  y_ND = combine(out_QD, gates_Nk, slot_Nk, keep_Nk, pair_Q, s.filled_Q)
  dropped = jnp.sum(valid_RL) * k - jnp.sum(s.keep_RA)
  return y_ND.reshape(r, l, d), dropped.astype(jnp.float32)


def _dispatch_dropless(x_ND, experts_Nk, gates_Nk, weights, cfg, exchange, n_shards):
  """Dropless over X expert shards: every token goes once to every shard (worst case,
  see MoeMlp)."""
  n, d = x_ND.shape
  local = cfg.n_experts // n_shards
  shard_X11 = jnp.arange(n_shards)[:, None, None]
  ids_XNk = jnp.where(experts_Nk // local == shard_X11, experts_Nk % local, local)
  spread = lambda t: jnp.broadcast_to(t, (n_shards,) + t.shape)
  x_XND, ids_XNk, gates_XNk = (exchange(t, 0) for t in (spread(x_ND), ids_XNk, spread(gates_Nk)))
  flat = lambda t: t.reshape((n_shards * n,) + t.shape[2:])
  max_rows = n_shards * n * min(cfg.top_k, local)
  how = cfg.grouped_matmul
  if how == "auto":  # tiles off TPU: faster on CPU and on an H200, see benchmarks/RESULTS.md
    how = "ragged_dot" if platform.backend() == "tpu" else "tiles"
  y_MD = _dropless(flat(x_XND), flat(ids_XNk), flat(gates_XNk), weights, local, max_rows, how,
                   cfg.fp8)
  y_XND = exchange(y_MD.astype(x_ND.dtype).reshape(n_shards, n, d), 0)
  return jnp.sum(y_XND.astype(jnp.float32), axis=0)


def _moe(x_BLD, valid_BL, router_DE, bias_E, weights, cfg, expert_axis, n_shards, manual_axes):
  """Routes and dispatches this shard's tokens; psums the stat sums over `manual_axes`."""
  b, l, d = x_BLD.shape
  e, cd = cfg.n_experts, cfg.compute_dtype
  # vary before the cast: gradients are then summed across shards in param dtype (and XLA:CPU 0.10.2
  # crashes on bf16 all-reduces: "Invalid binary instruction opcode copy")
  weights = collectives.vary(weights, tuple(a for a in manual_axes if a != expert_axis))
  weights = tuple(w.astype(cd) for w in weights)
  logits_BLE = jnp.einsum("BLD,DE->BLE", x_BLD.astype(jnp.float32), router_DE.astype(jnp.float32))
  experts_BLk, gates_BLk, probs_BLE = route(logits_BLE, bias_E, cfg)
  sums = _stat_sums(logits_BLE, experts_BLk, probs_BLE, valid_BL, e)
  experts_BLk = jnp.where(valid_BL[..., None], experts_BLk, e)  # padding: dispatched nowhere
  x_BLD = x_BLD.astype(cd)
  if expert_axis is None:
    exchange = lambda t, axis: t
  else:
    exchange = lambda t, axis: collectives.all_to_all(t, expert_axis, axis)
  if cfg.dispatch == "dropless":
    tokens = lambda t: t.reshape((b * l,) + t.shape[2:])
    y = _dispatch_dropless(tokens(x_BLD), tokens(experts_BLk), tokens(gates_BLk), weights, cfg,
                           exchange, n_shards)
  elif cfg.dispatch == "capacity":
    y, sums["dropped"] = _capacity(x_BLD, experts_BLk, gates_BLk, valid_BL, weights, cfg, exchange)
  else:
    raise ValueError(f"unknown dispatch {cfg.dispatch!r}")
  return y.reshape(b, l, d), collectives.psum(sums, manual_axes)


def _layout(batch):
  """(batch mesh axes to run manual over, expert mesh axis or None, expert shards), from the active
  logical-axis rules and mesh; axes of size 1 and axes already manual are left out. Inside a
  pipeline stage GSPMD places the dispatch (no shard_map): a shard_map nested in the stage's loses
  its place in the backward pass (its residuals' manual computation lowers outside the stage's,
  which Shardy rejects; jax 0.10)."""
  if pipeline.inside_stage():
    return (), None, 1
  batch_axes = collectives.mesh_axes(axes.BATCH)
  if batch % math.prod(collectives.axis_size(a) for a in batch_axes):
    return (), None, 1
  expert_axes = collectives.mesh_axes(axes.EXPERT)
  if len(expert_axes) > 1:
    raise ValueError(f"MoeMlp: logical 'expert' must map to one mesh axis, got {expert_axes}")
  if not expert_axes:
    return batch_axes, None, 1
  if expert_axes[0] not in batch_axes:
    raise ValueError(f"MoeMlp: expert parallelism needs the batch split over the expert mesh axis "
                     f"{expert_axes[0]!r} too (as in the fsdp_ep and fsdp_tp_ep rules)")
  return batch_axes, expert_axes[0], collectives.axis_size(expert_axes[0])


class MoeMlp(nn.Module):
  """Routed SwiGLU experts (+ optional shared experts): x [B, L, D] -> (y [B, L, D], float32 stats).

  Stats over valid tokens (valid_BL, None = all): aux_loss (E * sum_e f_e P_e), z_loss (mean
  logsumexp(logits)^2), load ([E] assignment fractions before capacity drops), dropped (fraction of
  assignments dropped), entropy (mean entropy of the normalized routing distribution). Padding
  tokens get zero routed output and are not dispatched or counted. Capacity groups and priority: see
  `capacity_slots`. Reads the `moe_state` collection (expert_bias) when cfg.bias_update_rate > 0;
  never writes it. `finish=False`: the stats' sums over tokens instead (finish_stats makes them).
  """
  cfg: "ModelConfig"  # noqa: F821 (jaxtrain.model.transformer.ModelConfig)
  finish: bool = True

  @nn.compact
  def __call__(self, x_BLD, valid_BL=None):
    c = self.cfg
    e, d, f = c.n_experts, c.d_model, c.expert_d_ff
    out_std = c.init_std / (2 * c.n_layers) ** 0.5
    router_DE = param(self, "router", (d, e), (axes.EMBED, None), c.param_dtype, c.init_std)
    w_gate = param(self, "gate", (e, d, f), (axes.EXPERT, axes.EMBED, axes.MLP), c.param_dtype,
                   c.init_std)
    w_up = param(self, "up", (e, d, f), (axes.EXPERT, axes.EMBED, axes.MLP), c.param_dtype,
                 c.init_std)
    w_down = param(self, "down", (e, f, d), (axes.EXPERT, axes.MLP, axes.EMBED), c.param_dtype,
                   out_std)
    bias_E = jnp.zeros((e,), jnp.float32)
    if c.bias_update_rate > 0:
      init = nn.with_logical_partitioning(lambda: jnp.zeros((e,), jnp.float32), (None,))
      bias_E = self.variable("moe_state", "expert_bias", init).value
    b, l, _ = x_BLD.shape
    valid_BL = jnp.ones((b, l), bool) if valid_BL is None else valid_BL.astype(bool)
    batch_axes, expert_axis, n_shards = _layout(b)
    if e % n_shards:
      raise ValueError(f"MoeMlp: {e} experts do not split over {n_shards} expert shards")
    moe = functools.partial(_moe, cfg=c, expert_axis=expert_axis, n_shards=n_shards,
                            manual_axes=batch_axes)
    if batch_axes:
      moe = collectives.shard_map(moe, batch_axes,
                                  in_specs=(P(batch_axes), P(batch_axes), P(), P(), P(expert_axis)),
                                  out_specs=(P(batch_axes), P()))
    y_BLD, sums = moe(x_BLD, valid_BL, router_DE, jax.lax.stop_gradient(bias_E),
                      (w_gate, w_up, w_down))
    if c.n_shared_experts:
      shared = dataclasses.replace(c, d_ff=c.n_shared_experts * f)
      y_BLD = y_BLD + Mlp(shared, name="shared")(x_BLD).astype(jnp.float32)
    return y_BLD.astype(c.compute_dtype), finish_stats(sums, c) if self.finish else sums
