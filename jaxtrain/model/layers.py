"""Small building blocks: parameters with logical names, RMSNorm, rotary embedding."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.model import axes


def param(module: nn.Module, name: str, shape, names, dtype, std: float | None):
  """A parameter with logical axis names; normal(std) init, or ones when std is None."""
  init = nn.initializers.ones if std is None else nn.initializers.normal(std)
  return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


class RMSNorm(nn.Module):
  """Root-mean-square norm (Zhang & Sennrich, 2019), computed in float32."""
  eps: float
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x_BLD):
    scale_D = param(self, "scale", (x_BLD.shape[-1],), (axes.EMBED,), self.param_dtype, None)
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale_D.astype(jnp.float32)).astype(x_BLD.dtype)


def rope(x_BLHK, positions_BL, theta: float):
  """Rotary position embedding (Su et al., 2021), in the half-split layout of HF Llama."""
  k = x_BLHK.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k)
  angle_BLU = positions_BL[..., None].astype(jnp.float32) * inv_freq
  sin, cos = jnp.sin(angle_BLU)[:, :, None, :], jnp.cos(angle_BLU)[:, :, None, :]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BLHK.dtype)
