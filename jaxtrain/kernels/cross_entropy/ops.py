"""The fused output projection + cross-entropy: `cross_entropy` picks an implementation; every one
but "full" has a custom_vjp whose backward recomputes the logits tile by tile ("chunked" in plain
JAX, "pallas" in Pallas kernels: interpreted on CPU, Triton on GPU, run per shard of the
tokens)."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jaxtrain import collectives
from jaxtrain.kernels.cross_entropy import chunked, kernel, reference
from jaxtrain.kernels import manual, platform

IMPLEMENTATIONS = ("full", "chunked", "pallas")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk):
  return chunked.forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk)[0]


def _chunked_fwd(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk):
  sums, lse_N = chunked.forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk,
                                vocab_chunk)
  return sums, (x_ND, w, targets_N, mask_N, lse_N)


def _chunked_bwd(z_loss, w_layout, token_chunk, vocab_chunk, res, g):
  x_ND, w, targets_N, mask_N, lse_N = res
  g_ce, g_z, _ = g
  dx_ND, dw = chunked.backward(x_ND, w, targets_N, mask_N, lse_N, g_ce, g_z, z_loss, w_layout,
                               token_chunk, vocab_chunk)
  return dx_ND, dw, None, jnp.zeros_like(mask_N)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _pad(a, axis: int, size: int):
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, widths)


def _padded(x_ND, w, rows_N, w_layout, block_n, block_v, block_d):
  """x, w (in x's dtype) and per-token rows padded: N, V and D to multiples of their blocks (zero
  columns of D leave x w as is). Padding copies w (weight-sized); when nothing needs padding jnp.pad
  is a no-op."""
  (n, d), v_axis = x_ND.shape, 1 if w_layout == "DV" else 0
  n_pad, d_pad = pl.cdiv(n, block_n) * block_n, pl.cdiv(d, block_d) * block_d
  v_pad = pl.cdiv(w.shape[v_axis], block_v) * block_v
  w = _pad(_pad(w.astype(x_ND.dtype), v_axis, v_pad), 1 - v_axis, d_pad)
  return _pad(_pad(x_ND, 0, n_pad), 1, d_pad), w, [_pad(r, 0, n_pad) for r in rows_N]


def _pallas_forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, block_n, block_v, block_d,
                    interpret):
  n, v = x_ND.shape[0], w.shape[1 if w_layout == "DV" else 0]
  x_pad, w_pad, (targets_pad,) = _padded(x_ND, w, [targets_N], w_layout, block_n, block_v, block_d)
  lse_N, target_logit_N = kernel.forward(x_pad, w_pad, targets_pad, vocab=v, w_layout=w_layout,
                                         block_n=block_n, block_v=block_v, block_d=block_d,
                                         interpret=interpret)
  lse_N, target_logit_N = lse_N[:n], target_logit_N[:n]
  ce = jnp.sum((lse_N - target_logit_N) * mask_N)
  z = z_loss * jnp.sum(jnp.square(lse_N) * mask_N)
  return (ce, z, jnp.sum(mask_N)), lse_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _pallas(x_ND, w, targets_N, mask_N, z_loss, w_layout, block_n, block_v, block_d, interpret):
  return _pallas_forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, block_n, block_v, block_d,
                         interpret)[0]


def _pallas_fwd(x_ND, w, targets_N, mask_N, z_loss, w_layout, block_n, block_v, block_d, interpret):
  sums, lse_N = _pallas_forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, block_n, block_v,
                                block_d, interpret)
  return sums, (x_ND, w, targets_N, mask_N, lse_N)


def _pallas_bwd(z_loss, w_layout, block_n, block_v, block_d, interpret, res, g):
  """d logit = coef p - g_target onehot, coef = m (g_ce + 2 z_loss g_z lse), g_target = m g_ce
  (kernel.py)."""
  x_ND, w, targets_N, mask_N, lse_N = res
  g_ce, g_z, _ = g
  (n, d), v = x_ND.shape, w.shape[1 if w_layout == "DV" else 0]
  coef_N = mask_N * (g_ce + 2.0 * z_loss * g_z * lse_N)
  rows = [targets_N, lse_N, coef_N, mask_N * g_ce]
  x_pad, w_pad, rows = _padded(x_ND, w, rows, w_layout, block_n, block_v, block_d)
  dx_ND, dw = kernel.backward(x_pad, w_pad, *rows, vocab=v, w_layout=w_layout, block_n=block_n,
                              block_v=block_v, block_d=block_d, interpret=interpret)
  dw = dw[:d, :v] if w_layout == "DV" else dw[:v, :d]
  return dx_ND[:n, :d].astype(x_ND.dtype), dw.astype(w.dtype), None, jnp.zeros_like(mask_N)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def cross_entropy(x_ND, w, targets_N, mask_N, z_loss: float = 0.0, *, w_layout: str = "DV",
                  impl: str = "chunked", token_chunk: int = 1024, vocab_chunk: int = 8192,
                  block_n: int = 32, block_v: int = 128, block_d: int = 64,
                  interpret: bool | None = None, tokens: P | None = None):
  """Sums over tokens (ce, z, tokens) of the logits x w (w [D, V], or [V, D] with w_layout="VD"), as
  reference.cross_entropy; "chunked" never holds more than a [token_chunk, vocab_chunk] tile of
  logits, "pallas" a [block_n, block_v] one, summed over blocks of block_d (powers of two >= 16,
  shrunk for small inputs; `interpret` defaults to True on CPU; compiled, the kernels run on each
  shard of the N tokens, laid out as `tokens`, the spec of their [B, L] grid, and w whole)."""
  if w_layout not in ("DV", "VD"):
    raise ValueError(f"w_layout must be DV or VD, got {w_layout!r}")
  if impl == "full":
    return reference.cross_entropy(x_ND, w, targets_N, mask_N, z_loss, w_layout)
  if impl == "chunked":
    return _chunked(x_ND, w, targets_N, mask_N.astype(jnp.float32), float(z_loss), w_layout,
                    int(token_chunk), int(vocab_chunk))
  if impl == "pallas":
    for name, block in (("block_n", block_n), ("block_v", block_v), ("block_d", block_d)):
      if block < 16 or block & (block - 1):
        raise ValueError(f"cross_entropy: {name}={block} must be a power of two >= 16")
    if interpret is None:
      interpret = platform.backend() == "cpu"
    if not interpret and platform.backend() == "tpu":
      raise ValueError("cross_entropy: the Pallas kernels are Triton's (GPU; interpreted on CPU): "
                       "they keep w whole per program, which Mosaic would copy into VMEM; on TPU "
                       "use chunked")

    def run(x_ND, w, targets_N, mask_N):
      (n, d), v = x_ND.shape, w.shape[1 if w_layout == "DV" else 0]
      bn, bv, bd = min(block_n, _tile(n)), min(block_v, _tile(v)), min(block_d, _tile(d))
      return _pallas(x_ND, manual.vary_like(w, x_ND), targets_N, mask_N, float(z_loss), w_layout,
                     bn, bv, bd, bool(interpret))

    args = (x_ND, w, targets_N.astype(jnp.int32), mask_N.astype(jnp.float32))
    if interpret:  # Pallas's interpreter cannot run under shard_map (kernels/manual.py)
      return run(*args)
    spec = manual.tokens_spec(tokens, 2)
    summed = lambda *a: collectives.psum(run(*a), manual.spec_axes(spec))
    return manual.per_shard(summed, (spec, P(), P(spec[0]), P(spec[0])), (P(), P(), P()))(*args)
  raise ValueError(
      f"cross_entropy: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")


def _tile(n: int) -> int:
  return max(16, pl.next_power_of_2(n))
