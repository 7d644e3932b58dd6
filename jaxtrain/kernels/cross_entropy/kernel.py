"""Pallas kernels of the output projection fused with cross-entropy + z-loss: the logits exist one
[block_n, block_v] tile at a time, in registers, never as [N, V] in memory.

Forward (grid over token blocks): each program loops over vocabulary blocks, computes the tile
x w in float32, keeps an online logsumexp (Milakov & Gimelshein, 2018) and picks each token's target
logit; it writes lse and the target logit per token, and ops.py sums the losses. Backward
recomputes every tile from x, w and the lse (as Liger Kernel and Cut Cross-Entropy, Wijmans et al.
2024, do). With p = softmax(logits) and cotangents g_ce, g_z of ce = sum m (lse - logit_t) and
z = z_loss sum m lse^2:
  d logit = coef p - m g_ce onehot(t),   coef = m (g_ce + 2 z_loss g_z lse)
  dx = d w^T (one kernel, grid over token blocks)
  dw = x^T d (another, grid over vocabulary blocks)

Written GPU-style (grid + BlockSpecs, lowered by Triton), interpreted on CPU. Shapes here are padded
by ops.py: N to a multiple of block_n (padded tokens have coef = 0), V to a multiple of block_v
(columns >= `vocab` are masked out of the logsumexp and the gradients), D to a multiple of block_d
(zero columns leave x w as is). x and w come in one (compute) dtype; w is [D, V] (w_layout "DV") or
[V, D] ("VD"). Every matmul takes a block of D, so tiles stay [block_n, block_d] x [block_d,
block_v] whatever the width; dx and dw accumulate in their float32 outputs one D block at a time
(each program owns its rows or columns: no atomics).
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.kernels import compiler, manual


def _dot(a, b):
  """a @ b accumulated in float32 (bf16 operands stay bf16, as the tensor cores take them)."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _w_tile(w_ref, cols, dims, w_layout: str):
  """The [dims, cols] tile of w, as [block_d, block_v] whatever the layout."""
  return w_ref[dims, cols] if w_layout == "DV" else w_ref[cols, dims].T


def _logits(x_ref, w_ref, rows, cols, shape, *, block_d: int, w_layout: str):
  """float32 `shape` = [block_n, block_v] tile x[rows] w[:, cols], summed over blocks of D (bounded
  tiles whatever the width)."""

  def body(k, acc):
    dims = pl.ds(k * block_d, block_d)
    return acc + _dot(x_ref[rows, dims], _w_tile(w_ref, cols, dims, w_layout))

  return lax.fori_loop(0, x_ref.shape[1] // block_d, body, jnp.zeros(shape, jnp.float32))


def _columns(j, block_n: int, block_v: int):
  """[block_n, block_v] vocabulary ids of the tile in block j."""
  return j * block_v + lax.broadcasted_iota(jnp.int32, (block_n, block_v), 1)


def _forward_kernel(x_ref, w_ref, targets_ref, lse_ref, target_logit_ref, *, block_v: int,
                    block_d: int, vocab: int, w_layout: str):
  """One token block against every vocabulary block: lse and target logit per token, float32."""
  targets = targets_ref[...]
  block_n = targets.shape[0]

  def body(j, carry):
    m, s, target_logit = carry
    ids = _columns(j, block_n, block_v)
    logits = _logits(x_ref, w_ref, slice(None), pl.ds(j * block_v, block_v), ids.shape,
                     block_d=block_d, w_layout=w_layout)
    # every block holds at least one real column, so m is finite after the first and exp(-inf - m) =
    # 0
    logits = jnp.where(ids < vocab, logits, -jnp.inf)
    m_next = jnp.maximum(m, jnp.max(logits, axis=1))
    s = s * jnp.exp(m - m_next) + jnp.sum(jnp.exp(logits - m_next[:, None]), axis=1)
    target_logit = target_logit + jnp.sum(jnp.where(ids == targets[:, None], logits, 0.0), axis=1)
    return m_next, s, target_logit

  init = (jnp.full((block_n,), -jnp.inf, jnp.float32), jnp.zeros((block_n,), jnp.float32),
          jnp.zeros((block_n,), jnp.float32))
  m, s, target_logit = lax.fori_loop(0, pl.cdiv(vocab, block_v), body, init)
  lse_ref[...] = m + jnp.log(s)
  target_logit_ref[...] = target_logit


def _dlogits(logits, ids, targets, lse, coef, g_target, vocab: int, dtype):
  """[block_n, block_v] gradient of the loss in the logits of one tile, in the compute dtype for the
  next matmul."""
  p = jnp.where(ids < vocab, jnp.exp(logits - lse[:, None]), 0.0)
  d = coef[:, None] * p - jnp.where(ids == targets[:, None], g_target[:, None], 0.0)
  return d.astype(dtype)


def _zero_by_d_blocks(ref, block_d: int, axis: int):
  """ref[...] = 0 one D block at a time (Triton's arrays are powers of two in size; D is only a
  multiple of block_d)."""

  shape = (ref.shape[0], block_d) if axis == 1 else (block_d, ref.shape[1])

  def body(k, carry):
    dims = pl.ds(k * block_d, block_d)
    ref[(slice(None), dims) if axis == 1 else (dims, slice(None))] = jnp.zeros(shape, ref.dtype)
    return carry

  lax.fori_loop(0, ref.shape[axis] // block_d, body, 0)


def _dx_kernel(x_ref, w_ref, targets_ref, lse_ref, coef_ref, g_target_ref, dx_ref, *, block_v: int,
               block_d: int, vocab: int, w_layout: str):
  """dx (float32) for one token block: the sum over vocabulary blocks of d_tile w_tile^T,
  accumulated in dx_ref one D block at a time."""
  targets, lse, coef, g_target = targets_ref[...], lse_ref[...], coef_ref[...], g_target_ref[...]
  block_n = targets.shape[0]
  _zero_by_d_blocks(dx_ref, block_d, axis=1)

  def body(j, carry):
    ids, cols = _columns(j, block_n, block_v), pl.ds(j * block_v, block_v)
    logits = _logits(x_ref, w_ref, slice(None), cols, ids.shape, block_d=block_d, w_layout=w_layout)
    d = _dlogits(logits, ids, targets, lse, coef, g_target, vocab, x_ref.dtype)

    def d_block(k, carry):
      dims = pl.ds(k * block_d, block_d)
      dx_ref[:, dims] += _dot(d, _w_tile(w_ref, cols, dims, w_layout).T)
      return carry

    return lax.fori_loop(0, x_ref.shape[1] // block_d, d_block, carry)

  lax.fori_loop(0, pl.cdiv(vocab, block_v), body, 0)


def _dw_kernel(x_ref, w_ref, targets_ref, lse_ref, coef_ref, g_target_ref, dw_ref, *, block_n: int,
               block_d: int, vocab: int, w_layout: str):
  """dw (float32) for one vocabulary block: the sum over token blocks of x_tile^T d_tile,
  accumulated in dw_ref one D block at a time."""
  block_v = w_ref.shape[1] if w_layout == "DV" else w_ref.shape[0]
  ids = _columns(pl.program_id(0), block_n, block_v)
  _zero_by_d_blocks(dw_ref, block_d, axis=0 if w_layout == "DV" else 1)

  def body(i, carry):
    rows = pl.ds(i * block_n, block_n)
    logits = _logits(x_ref, w_ref, rows, slice(None), ids.shape, block_d=block_d, w_layout=w_layout)
    d = _dlogits(logits, ids, targets_ref[rows], lse_ref[rows], coef_ref[rows], g_target_ref[rows],
                 vocab, x_ref.dtype)

    def d_block(k, carry):
      dims = pl.ds(k * block_d, block_d)
      x = x_ref[rows, dims]
      if w_layout == "DV":
        dw_ref[dims, :] += _dot(x.T, d)
      else:
        dw_ref[:, dims] += _dot(d.T, x)
      return carry

    return lax.fori_loop(0, x_ref.shape[1] // block_d, d_block, carry)

  lax.fori_loop(0, x_ref.shape[0] // block_n, body, 0)


def _compiler_params(block_n: int, block_v: int, interpret: bool):
  return compiler.params(1, interpret, num_warps=4 if block_n * block_v <= 64 * 64 else 8)


def _specs(x_ND, w, block_n: int, block_v: int, w_layout: str, by: str):
  """in_specs (x, w, then per-token rows) for a grid over token blocks
  (by="tokens") or vocabulary blocks."""
  n, d = x_ND.shape
  if by == "tokens":
    w_spec = pl.BlockSpec(w.shape, lambda i: (0, 0))
    return (pl.BlockSpec((block_n, d), lambda i: (i, 0)), w_spec,
            pl.BlockSpec((block_n,), lambda i: (i,)))
  w_spec = (pl.BlockSpec((d, block_v), lambda j: (0, j)) if w_layout == "DV" else
            pl.BlockSpec((block_v, d), lambda j: (j, 0)))
  return pl.BlockSpec((n, d), lambda j: (0, 0)), w_spec, pl.BlockSpec((n,), lambda j: (0,))


def forward(x_ND, w, targets_N, *, vocab: int, w_layout: str, block_n: int, block_v: int,
            block_d: int, interpret: bool):
  """(lse [N] float32, target logit [N] float32); grid over token blocks."""
  n = x_ND.shape[0]
  x_spec, w_spec, row = _specs(x_ND, w, block_n, block_v, w_layout, "tokens")
  return pl.pallas_call(
      functools.partial(_forward_kernel, block_v=block_v, block_d=block_d, vocab=vocab,
                        w_layout=w_layout),
      grid=(n // block_n,),
      in_specs=[x_spec, w_spec, row],
      out_specs=[row, row],
      out_shape=[manual.like((n,), jnp.float32, x_ND)] * 2,
      compiler_params=_compiler_params(block_n, block_v, interpret),
      interpret=interpret,
      name="cross_entropy_forward",
  )(x_ND, w, targets_N)


def backward(x_ND, w, targets_N, lse_N, coef_N, g_target_N, *, vocab: int, w_layout: str,
             block_n: int, block_v: int, block_d: int, interpret: bool):
  """(dx [N, D], dw in w's shape), float32: a dx kernel over token blocks and a dw kernel over
  vocabulary blocks, each recomputing the logits tiles it needs (coef, g_target = m g_ce: float32
  [N])."""
  n = x_ND.shape[0]
  args = (x_ND, w, targets_N, lse_N, coef_N, g_target_N)
  params = _compiler_params(block_n, block_v, interpret)
  x_spec, w_spec, row = _specs(x_ND, w, block_n, block_v, w_layout, "tokens")
  dx_ND = pl.pallas_call(
      functools.partial(_dx_kernel, block_v=block_v, block_d=block_d, vocab=vocab,
                        w_layout=w_layout),
      grid=(n // block_n,),
      in_specs=[x_spec, w_spec] + [row] * 4,
      out_specs=x_spec,
      out_shape=manual.like(x_ND.shape, jnp.float32, x_ND),
      compiler_params=params,
      interpret=interpret,
      name="cross_entropy_dx",
  )(*args)
  x_spec, w_spec, row = _specs(x_ND, w, block_n, block_v, w_layout, "vocab")
  dw = pl.pallas_call(
      functools.partial(_dw_kernel, block_n=block_n, block_d=block_d, vocab=vocab,
                        w_layout=w_layout),
      grid=(w.shape[1 if w_layout == "DV" else 0] // block_v,),
      in_specs=[x_spec, w_spec] + [row] * 4,
      out_specs=w_spec,
      out_shape=manual.like(w.shape, jnp.float32, x_ND),  # x's shard's part of dw
      compiler_params=params,
      interpret=interpret,
      name="cross_entropy_dw",
  )(*args)
  return dx_ND, dw
