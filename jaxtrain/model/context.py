"""Context parallelism: each row's tokens split over the mesh axes of the logical `seq` axis,
attention across the shards by all-gathering keys and values every layer (Llama 3, Dubey et al.,
2024, section 3.3.2).

Causal load balance: a row is cut into 2 x C chunks (C shards) and shard i holds chunks i and
2C-1-i, so every shard has as many keys in its past as any other. The task permutes its batch
(`balance`) before the model; each token keeps its index in the un-permuted row (`indices`), which
orders it causally, and its RoPE position, which travels with it. A token-summed loss needs no
un-permutation.

Shapes (jaxtrain/model/axes.py): q [B, L, H, K], k and v [B, S, G, K]; segment ids and indices [B,
L] / [B, S].
"""

import math

import jax.numpy as jnp

from jaxtrain import collectives
from jaxtrain.model import axes


def seq_axes() -> tuple[str, ...]:
  """Mesh axes the sequence is split over under the active rules (() when it is not split)."""
  return collectives.mesh_axes(axes.SEQ)


def shards() -> int:
  """Number of shards each row's tokens are split into (1 without context parallelism)."""
  return math.prod(collectives.axis_size(a) for a in seq_axes())


def permute(x_BL, c: int):
  """[B, L, ...] in row order -> load-balanced order for `c` shards:
  chunks 0, 2c-1, 1, 2c-2, ..., c-1, c."""
  b, l = x_BL.shape[:2]
  # H: the two halves, C: chunks, N: a chunk
  x_BHCN = x_BL.reshape(b, 2, c, l // (2 * c), *x_BL.shape[2:])
  pairs_BCHN = jnp.stack([x_BHCN[:, 0], jnp.flip(x_BHCN[:, 1], axis=1)], axis=2)
  return pairs_BCHN.reshape(x_BL.shape)


def unpermute(x_BL, c: int):
  """The inverse of `permute`: load-balanced order -> row order."""
  b, l = x_BL.shape[:2]
  pairs_BCHN = x_BL.reshape(b, c, 2, l // (2 * c), *x_BL.shape[2:])
  x_BHCN = jnp.stack([pairs_BCHN[:, :, 0], jnp.flip(pairs_BCHN[:, :, 1], axis=1)], axis=1)
  return x_BHCN.reshape(x_BL.shape)


def balance(batch: dict, c: int | None = None) -> dict:
  """A [B, L] batch (every array) laid out for causal load balance over `c` shards (default: the
  mesh's), with `indices`, each token's place in its un-permuted row, added. Unchanged when c ==
  1."""
  c = shards() if c is None else c
  if c == 1:
    return batch
  some = next(iter(batch.values()))
  indices_BL = jnp.broadcast_to(jnp.arange(some.shape[1], dtype=jnp.int32), some.shape[:2])
  return {k: permute(v, c) for k, v in {**batch, "indices": indices_BL}.items()}


def context_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                      attend_local):
  """Attention with the sequence split over the context shards: each shard's queries attend every
  shard's keys, all-gathered (with their segment ids and indices) along the length. `attend_local`
  has the signature of jaxtrain.kernels.attention.reference.attention; causality is by index, so a
  permuted row stays right."""
  names = seq_axes()
  if not names:
    return attend_local(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)

  # Manual over every axis these arrays are laid on (batch, sequence, heads): a collective in a
  # shard_map that leaves the data axes automatic made XLA gather the whole batch over them first.
  q_spec = collectives.logical_spec((axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM))
  kv_spec = collectives.logical_spec((axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM))
  ids_spec = collectives.logical_spec((axes.BATCH, axes.SEQ))
  manual = {a for spec in (q_spec, kv_spec, ids_spec) for entry in spec if entry
            for a in ((entry,) if isinstance(entry, str) else entry)}

  def local(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS):
    gather = lambda x: collectives.all_gather_along(x, names, dim=1)
    return attend_local(q_BLHK, gather(k_BSGK), gather(v_BSGK), q_segment_BL, gather(k_segment_BS),
                        q_index_BL, gather(k_index_BS))

  in_specs = (q_spec, kv_spec, kv_spec) + (ids_spec,) * 4
  return collectives.shard_map(local, tuple(manual), in_specs=in_specs, out_specs=q_spec)(
      q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)
