"""Pipeline parallelism of a layer stack over the mesh axis of the logical `layers` axis (`stage`):
GPipe's schedule (Huang et al., 2019) with circular repeats (Narayanan et al., 2021, the
interleaved schedule; MaxText's layers/pipeline.py).

With S stages, R repeats and Z layers, the stack's parameters [Z, ...] are read as
[R, S, Z/(R S), ...]: stage s holds layers r Z/R + s Z/(R S) + j and runs them for repeat r. The
batch is cut into M microbatches; item i = r M + m is microbatch m's pass through repeat r. At
iteration t stage s runs item t - s, then sends its output to stage s + 1 (the last stage's goes
back to stage 0): T = M R + S - 1 iterations, of which each stage idles S - 1 (the bubble,
(S - 1) / T). Stage 0 keeps, in a buffer of M microbatches, the inputs and what comes back for the
next repeat (M >= S when R > 1, so it is back in time); the last stage writes the final repeat's
outputs into its own. What a stage returns beside its output (the MoE layers' routing statistics as
sums over tokens) is added up over the microbatches in the loop's carry, by repeat, and comes out
per layer: the sums of the whole batch.

The stored parameters keep the unpipelined tree (a checkpoint moves between the two), sharded
contiguously over the stages: stage s holds blocks s R .. s R + R - 1 of Z/(R S) layers. With R = 1
that is the block it runs; with R > 1 it runs blocks s, S + s, ..., so each step exchanges the
blocks once, in R rounds of ppermute (`circular_rounds`), and the gradients go back the same way:
every stage sends and receives (R - 1)/R of its share, never the whole stack. Each iteration is rematerialized: with `model.remat` on, its
input is all it keeps for the backward pass (the layers' own policy applies when it is recomputed);
off, it keeps everything but its slice of the weights.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxtrain import collectives
from jaxtrain.model import axes

WEIGHTS = "pipeline_weights"  # a stage's slice of the weights for one repeat: never saved


def stage_axis() -> str:
  """The mesh axis the stacked layers lie on, "" when it is not split (no pipeline)."""
  names = collectives.mesh_axes(axes.LAYERS)
  if len(names) > 1:
    raise ValueError(f"the layers lie on mesh axes {names}: a pipeline runs over one")
  return names[0] if names else ""


def inside_stage() -> bool:
  """Whether this is traced inside a pipeline stage (the shard_map over the layers' mesh axis)."""
  spec = nn.logical_to_mesh_axes((axes.LAYERS,))[0]
  names = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  return any(a in collectives.manual_axes() for a in names)


def split_microbatches(x, m: int):
  """[B, ...] -> [M, B/M, ...], microbatch k taking rows k, k + M, ...: each keeps the batch's
  sharding."""
  if x.shape[0] % m:
    raise ValueError(f"a batch of {x.shape[0]} rows does not divide into {m} pipeline microbatches")
  return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def join_microbatches(x):
  """The inverse of split_microbatches: [M, B/M, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def iterations(stages: int, repeats: int, microbatches: int) -> int:
  """Iterations of the schedule: M R + S - 1."""
  return microbatches * repeats + stages - 1


def circular_rounds(stages: int, repeats: int) -> list[list[tuple[int, int, int, int]]]:
  """The exchange from contiguous blocks to circular ones, as R rounds of one block a stage.

  Block b (layers b Z/(R S) ..) lies on stage b // R (slot b % R) and runs on stage b % S as
  repeat b // S. Every stage sends R blocks and receives R, so the moves split into R perfect
  matchings (Koenig), each one ppermute: round k is [(source, slot, destination, repeat)], one
  entry a source stage."""
  moves = [(b // repeats, b % repeats, b % stages, b // stages) for b in range(stages * repeats)]
  rounds = []
  while moves:
    match = {}  # destination -> move

    def augment(src, seen):  # Kuhn: give `src` a destination, moving others if need be
      for move in moves:
        if move[0] == src and move[2] not in seen:
          seen.add(move[2])
          if move[2] not in match or augment(match[move[2]][0], seen):
            match[move[2]] = move
            return True
      return False

    for src in range(stages):
      if not augment(src, set()):
        raise AssertionError(f"no perfect matching left for {stages} stages x {repeats} repeats")
    rounds.append(sorted(match.values()))
    for move in match.values():
      moves.remove(move)
  return rounds


def _to_circular(blocks, axis: str, s, rounds):
  """This stage's contiguous [R, Z/(R S), ...] -> the blocks it runs, [R, Z/(R S), ...] by repeat."""
  got, repeat_of = [], []
  for moves in rounds:
    slot = jnp.asarray([m[1] for m in moves])[s]  # moves are sorted by source stage
    pairs = [(m[0], m[2]) for m in moves]
    stay = all(a == b for a, b in pairs)  # every stage keeps a block of its own: nothing to send
    got.append(blocks[slot] if stay else collectives.permute(blocks[slot], axis, pairs))
    repeat_of.append({m[2]: m[3] for m in moves})
  order = [[next(k for k, r in enumerate(repeat_of) if r[d] == rep) for rep in range(len(rounds))]
           for d in range(len(repeat_of[0]))]  # destination -> the round each repeat came in
  return jnp.stack(got)[jnp.asarray(order)[s]]


def schedule(stages: int, repeats: int, microbatches: int) -> np.ndarray:
  """[T, S]: the item stage s runs at iteration t (i = r M + m: microbatch m, repeat r), -1 where it
  idles. The loop reads its items from this table."""
  t = np.arange(iterations(stages, repeats, microbatches))[:, None]
  i = t - np.arange(stages)[None]
  return np.where((i >= 0) & (i < microbatches * repeats), i, -1).astype(np.int32)


def bubble(stages: int, repeats: int, microbatches: int) -> float:
  """The share of (stage, iteration) slots of the schedule in which a stage idles."""
  return float(np.mean(schedule(stages, repeats, microbatches) < 0))


def pipeline(stage_fn, params, x_BLD, rows: dict, *, repeats: int, microbatches: int,
             remat: bool):
  """The layer stack `params` (leaves [Z, ...]) applied to `x_BLD`, pipelined over the stage axis:
  (y [B, L, D], the per-layer sums [Z, ...] of what the stages return beside their output).

  `stage_fn(params, x_bLD, rows) -> (y_bLD, sums)` runs Z/(R S) consecutive layers (leaves
  [Z/(R S), ...]); `sums`, a pytree of per-layer leaves [Z/(R S), ...] (None: nothing), are added up
  over the microbatches (MoE statistics as sums over tokens: those of the whole batch). `params` may
  hold several collections (the MoE expert bias beside the weights), every leaf [Z, ...]. `rows` are
  per-row [B, L] inputs (positions, segment ids), cut into microbatches alongside x."""
  axis = stage_axis()
  s_count, m_count = collectives.axis_size(axis), microbatches

  rounds = circular_rounds(s_count, repeats) if repeats > 1 else []
  x_MbLD = split_microbatches(x_BLD, m_count)
  rows = {k: split_microbatches(v, m_count) for k, v in rows.items()}

  def stage(params, x_bLD, rows, i):  # item i: its repeat's layers on its microbatch
    r = jnp.clip(i // m_count, 0, repeats - 1)
    weights = jax.tree.map(lambda p: checkpoint_name(p[r], WEIGHTS), params)
    return stage_fn(weights, x_bLD, {k: v[i % m_count] for k, v in rows.items()})

  policy = (jax.checkpoint_policies.nothing_saveable if remat else
            jax.checkpoint_policies.save_anything_except_these_names(WEIGHTS))
  stage = jax.checkpoint(stage, policy=policy, prevent_cse=False)

  def local(params, x_MbLD, rows):
    s = collectives.axis_index(axis)
    items = jnp.asarray(schedule(s_count, repeats, m_count))
    params = jax.tree.map(  # this stage's contiguous [R, Z/(R S), ...], then the ones it runs
        lambda p: p.reshape(repeats, p.shape[0] // repeats, *p.shape[1:]), params)
    if rounds:
      params = jax.tree.map(lambda p: _to_circular(p, axis, s, rounds), params)
    sums_shape = jax.eval_shape(stage, params, collectives.vary(x_MbLD[0], (axis,)), rows, 0)[1]

    def iteration(carry, t):
      cur_bLD, io_MbLD, sums = carry
      i = items[t, s]  # the item this stage runs, -1: none (its work is computed and dropped)
      back = t - s_count  # the item the last stage sent to stage 0 at the end of iteration t - 1
      keep = (s == 0) & (back >= 0) & (back // m_count < repeats - 1)
      io_MbLD = io_MbLD.at[back % m_count].set(
          jnp.where(keep, cur_bLD, io_MbLD[back % m_count]))
      cur_bLD = jnp.where(s == 0, io_MbLD[t % m_count], cur_bLD)
      y_bLD, item_sums = stage(params, cur_bLD, rows, i)
      r = jnp.clip(i // m_count, 0, repeats - 1)
      sums = jax.tree.map(lambda acc, new: acc.at[r].add(jnp.where(i >= 0, new, 0)), sums,
                          item_sums)
      done = (s == s_count - 1) & (i >= 0) & (i // m_count == repeats - 1)
      io_MbLD = io_MbLD.at[i % m_count].set(jnp.where(done, y_bLD, io_MbLD[i % m_count]))
      return (collectives.ppermute(y_bLD, axis), io_MbLD, sums), None

    sums = jax.tree.map(lambda a: jnp.zeros((repeats, *a.shape), a.dtype), sums_shape)
    carry = collectives.vary((jnp.zeros_like(x_MbLD[0]), x_MbLD, sums), (axis,))
    steps = jnp.arange(iterations(s_count, repeats, m_count))
    _, io_MbLD, sums = jax.lax.scan(iteration, carry, steps)[0]
    out = collectives.psum(jnp.where(s == s_count - 1, io_MbLD, 0), (axis,))
    return out, jax.tree.map(lambda a: a[None], sums)  # [1 (this stage), R, Z/(R S), ...]

  specs = jax.tree.map(lambda _: P(axis), params)
  out_MbLD, sums = collectives.shard_map(local, (axis,), in_specs=(specs, P(), P()),
                                         out_specs=(P(), P(axis)))(params, x_MbLD, rows)
  # [S, R, Z/(R S), ...] -> [Z, ...]: stage s runs layers r Z/R + s Z/(R S) + j in repeat r
  sums = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[3:]), sums)
  return join_microbatches(out_MbLD), sums
