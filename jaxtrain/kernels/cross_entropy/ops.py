"""The fused output projection + cross-entropy: `cross_entropy` picks an implementation; every one but
"full" has a custom_vjp whose backward recomputes the logits tile by tile."""

import functools

import jax
import jax.numpy as jnp

from jaxtrain.kernels.cross_entropy import chunked, reference

IMPLEMENTATIONS = ("full", "chunked")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk):
  return chunked.forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk)[0]


def _chunked_fwd(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk):
  sums, lse_N = chunked.forward(x_ND, w, targets_N, mask_N, z_loss, w_layout, token_chunk, vocab_chunk)
  return sums, (x_ND, w, targets_N, mask_N, lse_N)


def _chunked_bwd(z_loss, w_layout, token_chunk, vocab_chunk, res, g):
  x_ND, w, targets_N, mask_N, lse_N = res
  g_ce, g_z, _ = g
  dx_ND, dw = chunked.backward(x_ND, w, targets_N, mask_N, lse_N, g_ce, g_z, z_loss, w_layout, token_chunk,
                               vocab_chunk)
  return dx_ND, dw, None, jnp.zeros_like(mask_N)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def cross_entropy(x_ND, w, targets_N, mask_N, z_loss: float = 0.0, *, w_layout: str = "DV", impl: str = "chunked",
                  token_chunk: int = 1024, vocab_chunk: int = 8192):
  """Sums over tokens (ce, z, tokens) of the logits x w (w [D, V], or [V, D] with w_layout="VD"), as
  reference.cross_entropy; "chunked" never holds more than a [token_chunk, vocab_chunk] tile of logits."""
  if w_layout not in ("DV", "VD"):
    raise ValueError(f"w_layout must be DV or VD, got {w_layout!r}")
  if impl == "full":
    return reference.cross_entropy(x_ND, w, targets_N, mask_N, z_loss, w_layout)
  if impl == "chunked":
    return _chunked(x_ND, w, targets_N, mask_N.astype(jnp.float32), float(z_loss), w_layout, int(token_chunk),
                    int(vocab_chunk))
  raise ValueError(f"cross_entropy: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
