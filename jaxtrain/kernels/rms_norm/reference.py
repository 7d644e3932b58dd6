"""Residual add + RMSNorm (Zhang & Sennrich, 2019) in plain jnp: the definition the kernel is held
to, and the same arithmetic as the decoder block's `x + attn(...)` followed by
jaxtrain.model.layers.RMSNorm.

Shapes: x and residual [N, D] (any leading axes), scale [D]."""

import jax
import jax.numpy as jnp


def add_rms_norm(x_ND, residual_ND, scale_D, eps: float):
  """(normed, new residual): h = residual + x, normed = h / rms(h) * scale in float32,
  cast to h's dtype."""
  h_ND = residual_ND + x_ND
  h = h_ND.astype(jnp.float32)
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  return (h * scale_D.astype(jnp.float32)).astype(h_ND.dtype), h_ND
