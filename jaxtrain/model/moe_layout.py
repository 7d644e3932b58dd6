"""Where each routed assignment goes, and the gathers that move rows there and back.

The index maps of the two dispatch modes, both from one stable sort of the assignments by expert:
`capacity_slots` (expert-major [E, R, C] buffers with the capacity rule) and `tile_layout` (each
expert's rows padded to whole tiles, for the dropless grouped matmul). `take` gathers rows along
such a map with a custom VJP whose transpose is the inverse gather: XLA transposes a gather to a
scatter-add, which runs serially on CPU and with atomics on GPU, and cannot know that the indices
are unique. `combine` gathers each token's k expert outputs back and sums them with the gates.

Shape letters: see jaxtrain/model/axes.py.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


def sort_by_expert(experts_RA, n_experts):
  """Stable sort of each row's assignments by expert id (id n_experts = not here, sorts last).

  -> order_RA (sorted position -> assignment), inverse_RA (assignment -> sorted position),
  sizes_RE (assignments per expert, int32), rank_RA (position of an assignment within its expert).
  """
  order_RA = jnp.argsort(experts_RA, axis=-1, stable=True)
  iota_A = jnp.arange(experts_RA.shape[-1], dtype=jnp.int32)
  scatter = jax.vmap(lambda dest, value: jnp.zeros_like(value).at[dest].set(value))
  inverse_RA = scatter(order_RA, jnp.broadcast_to(iota_A, order_RA.shape))
  sizes_RE = jax.vmap(lambda e: jnp.bincount(e, length=n_experts + 1))(experts_RA).astype(jnp.int32)
  starts_RE = jnp.cumsum(sizes_RE, axis=-1) - sizes_RE
  rank_RA = inverse_RA - jnp.take_along_axis(starts_RE, experts_RA, axis=-1)
  return order_RA, inverse_RA, sizes_RE[:, :n_experts], rank_RA


class Tiles(NamedTuple):
  """The dropless tile layout of A assignments: each expert's rows padded to whole tiles of `tile`
  rows, tiles in expert order, P = T * tile rows in all (T a static bound)."""
  expert_T: jax.Array   # the expert of tile t (padding tiles past the last: E - 1, and empty)
  row_A: jax.Array      # assignment -> its row (0 when the id is not an expert here)
  source_P: jax.Array   # row -> the assignment it holds (0 when empty)
  filled_P: jax.Array   # bool: row p holds one
  tile: int


def tile_layout(experts_A, n_experts, max_rows, tile) -> Tiles:
  """Rows of every expert's assignments, padded per expert to a multiple of `tile`. `max_rows`
  bounds the real assignments, so T = ceil(max_rows / tile) + E tiles always suffice."""
  a = experts_A.shape[0]
  order_A, _, sizes_E, rank_A = (t[0] for t in sort_by_expert(experts_A[None], n_experts))
  n_tiles = -(-max_rows // tile) + n_experts
  tiles_E = -(-sizes_E // tile)
  first_E = jnp.cumsum(tiles_E) - tiles_E  # first tile of each expert
  iota_T = jnp.arange(n_tiles, dtype=jnp.int32)
  # (jnp.searchsorted fails in shard_map, jax 0.10)
  ended_TE = (first_E + tiles_E)[None, :] <= iota_T[:, None]
  expert_T = jnp.minimum(jnp.sum(ended_TE, axis=1, dtype=jnp.int32), n_experts - 1)
  real_A = experts_A < n_experts
  row_A = jnp.where(real_A, first_E[jnp.minimum(experts_A, n_experts - 1)] * tile + rank_A, 0)
  expert_P = jnp.repeat(expert_T, tile)
  rank_P = jnp.arange(n_tiles * tile, dtype=jnp.int32) - first_E[expert_P] * tile
  filled_P = rank_P < sizes_E[expert_P]  # past-the-end tiles: rank >= size of the last expert
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  source_P = jnp.where(filled_P, order_A[jnp.clip(starts_E[expert_P] + rank_P, 0, a - 1)], 0)
  return Tiles(expert_T.astype(jnp.int32), row_A, source_P, filled_P, tile)


def tile_size(max_rows, n_experts):
  """Rows per tile: the power of two nearest the mean rows per expert, within [8, 128] (MegaBlocks'
  128): padding costs up to E * (tile - 1) rows, gathering weights T * 3 * D * F."""
  mean = max(max_rows // n_experts, 1)
  return int(min(128, max(8, 2 ** round(math.log2(mean)))))


class Slots(NamedTuple):
  """The capacity layout of R rows: assignments (a = j * L + l, choice j of token l) <-> slots of
  the expert-major buffers [E, R, C] (slot q = (e * R + r) * C + c)."""
  keep_RA: jax.Array    # bool: the assignment has a slot (not dropped, not padding)
  slot_RA: jax.Array    # its slot (0 when not kept)
  source_Q: jax.Array   # which assignment slot q holds, as r * A + a (0 when empty)
  filled_Q: jax.Array   # bool: slot q holds one
  capacity: int         # C, slots per expert and row


def capacity_slots(experts_RLk, valid_RL, n_experts, capacity_factor) -> Slots:
  """Buffer slot of every assignment under the capacity rule.

  A group is one row (sequence) of L tokens. Its capacity is C_row = ceil(capacity_factor * n * k /
  E) with n the row's valid tokens (computed in float32); buffers hold C = ceil(capacity_factor * L
  * k / E) >= C_row slots per expert. Priority (GShard/Switch): every first choice before any second
  choice, and so on; within one choice, tokens in order. An expert keeps its first C_row assignments
  and drops the rest. Both directions of the map come from one stable sort by expert, so that
  dispatch and combine are gathers (no scatter), forward and backward (`take`).
  """
  r, l, k = experts_RLk.shape
  a, e = l * k, n_experts
  c = math.ceil(capacity_factor * a / e)
  experts_RA = jnp.swapaxes(jnp.where(valid_RL[..., None], experts_RLk, e), 1, 2).reshape(r, a)
  order_RA, _, sizes_RE, rank_RA = sort_by_expert(experts_RA, e)
  tokens_R = jnp.sum(valid_RL, axis=-1).astype(jnp.float32)
  cap_R = jnp.minimum(jnp.ceil(capacity_factor * tokens_R * k / e).astype(jnp.int32), c)
  keep_RA = (experts_RA < e) & (rank_RA < cap_R[:, None])
  row_R1 = jnp.arange(r, dtype=jnp.int32)[:, None]
  slot_RA = jnp.where(keep_RA, (experts_RA * r + row_R1) * c + rank_RA, 0)
  # slot (e, r, c) holds the row's sorted assignment starts[r, e] + c, if c < min(size, C_row)
  starts_ER = (jnp.cumsum(sizes_RE, axis=-1) - sizes_RE).T
  iota_C = jnp.arange(c, dtype=jnp.int32)
  position_ERC = jnp.minimum(starts_ER[..., None] + iota_C, a - 1)
  source_ERC = row_R1[None] * a + order_RA[row_R1[None], position_ERC]
  filled_ERC = iota_C < jnp.minimum(sizes_RE, cap_R[:, None]).T[..., None]
  return Slots(keep_RA, slot_RA,
               jnp.where(filled_ERC, source_ERC, 0).reshape(-1), filled_ERC.reshape(-1), c)


def gather_sum(src_ID, index_MJ, mask_MJ):
  """out[m] = sum over J of src[index[m, J]] where mask[m, J] -> [M, D]."""
  rows = [jnp.where(mask_MJ[:, j, None], jnp.take(src_ID, index_MJ[:, j], axis=0, mode="clip"),
                    jnp.zeros((), src_ID.dtype)) for j in range(index_MJ.shape[1])]
  if len(rows) == 1:
    return rows[0]
  # J gathers added elementwise: XLA:CPU ran one [M, J, D] gather reduced over J slower
  # (benchmarks/RESULTS.md)
  return functools.reduce(jnp.add, [row.astype(jnp.float32) for row in rows]).astype(src_ID.dtype)


@jax.custom_vjp
def take(src_ID, index_MJ, mask_MJ, inverse_IJ, inverse_mask_IJ):
  """`gather_sum` for a partial one-to-one map between the (m, j) pairs and src rows, whose inverse
  lists for each src row i the flat pairs m * J + j reading it: the transpose is then a gather the
  other way."""
  return gather_sum(src_ID, index_MJ, mask_MJ)


def _take_fwd(src_ID, index_MJ, mask_MJ, inverse_IJ, inverse_mask_IJ):
  return gather_sum(src_ID, index_MJ, mask_MJ), (index_MJ, mask_MJ, inverse_IJ, inverse_mask_IJ)


def _take_bwd(residuals, ct_MD):
  index_MJ, mask_MJ, inverse_IJ, inverse_mask_IJ = residuals
  width = index_MJ.shape[1]  # pair m * J + j reads ct[m]
  return gather_sum(ct_MD, inverse_IJ // width, inverse_mask_IJ), None, None, None, None


take.defvjp(_take_fwd, _take_bwd)


def combine(out_QD, gates_Nk, slot_Nk, keep_Nk, pair_Q, filled_Q):
  """y[n] = sum over its kept choices j of gate[n, j] * out[slot[n, j]], in float32; slot q holds
  the pair pair_Q = n * k + j when filled. Gates are applied per slot, so the gather and the sum
  over k fuse and no [N, k, D] array is made."""
  gate_Q = take(gates_Nk.reshape(-1, 1), pair_Q[:, None], filled_Q[:, None], slot_Nk.reshape(-1, 1),
                keep_Nk.reshape(-1, 1))
  return take(
      out_QD.astype(jnp.float32) * gate_Q, slot_Nk, keep_Nk, pair_Q[:, None], filled_Q[:, None])
