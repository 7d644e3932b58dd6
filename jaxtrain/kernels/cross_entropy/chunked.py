"""Cross-entropy of the output projection in plain JAX, chunked over tokens and vocabulary: the
logits exist one [token chunk, vocab chunk] tile at a time, the forward keeps an online logsumexp
over vocabulary chunks (Milakov & Gimelshein, 2018), and the backward recomputes each tile from x, w
and the saved logsumexp (as Liger Kernel's and Apple's Cut Cross-Entropy do, Wijmans et al. 2024).
Memory is O(chunk), not O(N V).

Token chunks are strided (chunk c holds tokens c, c + n_chunks, ...), so a batch-sharded N stays
sharded inside every chunk. The last vocabulary chunk is clamped to end at V and masks the columns
it shares with the one before, so w is never padded or copied.
"""

import jax
import jax.numpy as jnp


def _tile_logits(x_cD, w, start, vc: int, w_layout: str):
  """float32 [c, vc]: logits of the vocabulary columns [start, start + vc)."""
  if w_layout == "DV":
    w_Dv = jax.lax.dynamic_slice_in_dim(w, start, vc, axis=1).astype(x_cD.dtype)
    return jnp.einsum("cD,Dv->cv", x_cD, w_Dv, preferred_element_type=jnp.float32)
  w_vD = jax.lax.dynamic_slice_in_dim(w, start, vc, axis=0).astype(x_cD.dtype)
  return jnp.einsum("cD,vD->cv", x_cD, w_vD, preferred_element_type=jnp.float32)


def _sizes(n: int, v: int, token_chunk: int, vocab_chunk: int):
  tc, vc = min(token_chunk, n), min(vocab_chunk, v)
  return tc, -(-n // tc), vc, -(-v // vc)


def _vocab_tile(j, vc: int, v: int, targets_c):
  """Start of vocabulary chunk j, which of its columns are its own,
  and which hold each token's target."""
  start = jnp.minimum(j * vc, v - vc)
  ids_v = start + jnp.arange(vc)
  own_v = ids_v >= j * vc
  return start, own_v, own_v[None, :] & (ids_v[None, :] == targets_c[:, None])


def _strided(a, tc: int, nc: int):
  """[N, ...] -> [n_chunks, tc, ...], zero-padded; chunk c holds tokens c, c + n_chunks, ..."""
  a = jnp.pad(a, [(0, tc * nc - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
  return jnp.swapaxes(a.reshape(tc, nc, *a.shape[1:]), 0, 1)


def _unstrided(a, n: int):
  return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])[:n]


def forward(x_ND, w, targets_N, mask_N, z_loss: float, w_layout: str, token_chunk: int,
            vocab_chunk: int):
  """((ce, z, tokens), logsumexp [N] float32) with logits computed tile by tile."""
  n, v = x_ND.shape[0], w.shape[1 if w_layout == "DV" else 0]
  tc, nc, vc, nv = _sizes(n, v, token_chunk, vocab_chunk)

  def token_chunk_lse(args):
    x_cD, targets_c = args

    def vocab_step(j, carry):
      m_c, s_c, target_c = carry
      start, own_v, hit_cv = _vocab_tile(j, vc, v, targets_c)
      logits_cv = jnp.where(own_v[None, :], _tile_logits(x_cD, w, start, vc, w_layout), -jnp.inf)
      m_new = jnp.maximum(m_c, jnp.max(logits_cv, axis=-1))
      s_c = s_c * jnp.exp(m_c - m_new) + jnp.sum(jnp.exp(logits_cv - m_new[:, None]), axis=-1)
      return m_new, s_c, target_c + jnp.sum(jnp.where(hit_cv, logits_cv, 0.0), axis=-1)

    init = (jnp.full([tc], -jnp.inf), jnp.zeros([tc]), jnp.zeros([tc]))
    m_c, s_c, target_c = jax.lax.fori_loop(0, nv, vocab_step, init)
    return m_c + jnp.log(s_c), target_c

  lse_ctc, target_ctc = jax.lax.map(token_chunk_lse,
                                    (_strided(x_ND, tc, nc), _strided(targets_N, tc, nc)))
  lse_N, target_N = _unstrided(lse_ctc, n), _unstrided(target_ctc, n)
  ce = jnp.sum((lse_N - target_N) * mask_N)
  z = z_loss * jnp.sum(jnp.square(lse_N) * mask_N)
  return (ce, z, jnp.sum(mask_N)), lse_N


def backward(x_ND, w, targets_N, mask_N, lse_N, g_ce, g_z, z_loss: float, w_layout: str,
             token_chunk: int, vocab_chunk: int):
  """(dx [N, D] in x's dtype, dw in w's shape and dtype) for cotangents g_ce, g_z of (ce, z),
  recomputing each logits tile: d logit = mask (g_ce (p - onehot) + 2 z_loss g_z lse p)."""
  n, v = x_ND.shape[0], w.shape[1 if w_layout == "DV" else 0]
  tc, nc, vc, nv = _sizes(n, v, token_chunk, vocab_chunk)
  ce_spec = "cv,Dv->cD" if w_layout == "DV" else "cv,vD->cD"
  dw_spec = "cD,cv->Dv" if w_layout == "DV" else "cD,cv->vD"
  axis = 1 if w_layout == "DV" else 0

  def token_step(dw, args):
    x_cD, targets_c, mask_c, lse_c = args
    coef_c = mask_c * (g_ce + 2.0 * z_loss * g_z * lse_c)

    def vocab_step(j, carry):
      dx_cD, dw = carry
      start, own_v, hit_cv = _vocab_tile(j, vc, v, targets_c)
      p_cv = jnp.where(own_v[None, :],
                       jnp.exp(_tile_logits(x_cD, w, start, vc, w_layout) - lse_c[:, None]), 0.0)
      d_cv = (coef_c[:, None] * p_cv - jnp.where(hit_cv,
                                                 (mask_c * g_ce)[:, None], 0.0)).astype(x_cD.dtype)
      w_tile = jax.lax.dynamic_slice_in_dim(w, start, vc, axis=axis).astype(x_cD.dtype)
      dx_cD = dx_cD + jnp.einsum(ce_spec, d_cv, w_tile, preferred_element_type=jnp.float32)
      dw_tile = jax.lax.dynamic_slice_in_dim(dw, start, vc, axis=axis)
      dw_tile = dw_tile + jnp.einsum(dw_spec, x_cD, d_cv, preferred_element_type=jnp.float32)
      return dx_cD, jax.lax.dynamic_update_slice_in_dim(dw, dw_tile, start, axis=axis)

    dx_cD, dw = jax.lax.fori_loop(0, nv, vocab_step, (jnp.zeros(x_cD.shape, jnp.float32), dw))
    return dw, dx_cD

  xs = tuple(_strided(a, tc, nc) for a in (x_ND, targets_N, mask_N, lse_N))
  dw, dx_ctcD = jax.lax.scan(token_step, jnp.zeros(w.shape, jnp.float32), xs)
  return _unstrided(dx_ctcD, n).astype(x_ND.dtype), dw.astype(w.dtype)
