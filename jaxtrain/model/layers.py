"""Small building blocks: parameters with logical names, RMSNorm, LayerNorm,
rotary embedding and its scalings."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


class LayerNorm(nn.Module):
  """Layer normalization with scale and bias (Ba et al., 2016), computed in float32 (BERT's)."""
  eps: float
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x_BLD):
    d = x_BLD.shape[-1]
    scale_D = param(self, "scale", (d,), (axes.EMBED,), self.param_dtype, None)
    bias_D = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
                        (d,), self.param_dtype)
    x = x_BLD.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(var + self.eps)
    return (x * scale_D.astype(jnp.float32) + bias_D.astype(jnp.float32)).astype(x_BLD.dtype)


def _powers(theta: float, k: int):
  """theta ** (2i / k) for i < k / 2: the rotary wavelengths over 2 pi, in float32 rounded once from
  float64, as torch's powf rounds them (numpy's float32 power is off by an ulp in a fifth of
  them)."""
  return (theta ** (np.arange(0, k, 2, dtype=np.float32) / k).astype(np.float64)).astype(np.float32)


def _rdiv(s: float, x):
  """s / x as torch computes a Python number over a float32 tensor: x's reciprocal times s."""
  return (1 / x) * np.float32(s)


def _linear(c, k: int):
  """Position interpolation (Chen et al., 2023): every frequency divided by the factor."""
  return 1 / _powers(c.rope_theta, k) / c.rope_factor


def _llama3(c, k: int):
  """Llama 3.1's scaling (Grattafiori et al., 2024): wavelengths above original_max_len /
  low_freq_factor divided by the factor, below original_max_len / high_freq_factor kept, a smooth
  mix in between."""
  inv_freq_U = 1 / _powers(c.rope_theta, k)
  old, low = c.rope_original_max_len, c.rope_low_freq_factor
  high, factor = c.rope_high_freq_factor, c.rope_factor
  wavelen_U = _rdiv(2 * math.pi, inv_freq_U)
  scaled_U = np.where(wavelen_U > old / low, inv_freq_U / factor, inv_freq_U)
  smooth_U = (_rdiv(old, wavelen_U) - low) / (high - low)
  smoothed_U = (1 - smooth_U) * scaled_U / factor + smooth_U * scaled_U
  medium_U = ~(wavelen_U < old / high) & ~(wavelen_U > old / low)
  return np.where(medium_U, smoothed_U, scaled_U)


def _yarn(c, k: int):
  """YaRN's "NTK-by-parts" frequencies (Peng et al., 2023): dimensions that turn more than beta_fast
  times over original_max_len keep their frequency, those under beta_slow turn factor times slower,
  a linear ramp between."""
  base, factor, old = c.rope_theta, c.rope_factor, c.rope_original_max_len
  dim = lambda rotations: (k * math.log(old / (rotations * 2 * math.pi))  # noqa: E731
                           / (2 * math.log(base)))
  low = max(math.floor(dim(c.rope_beta_fast)), 0)
  high = min(math.ceil(dim(c.rope_beta_slow)), k - 1)
  high = high + 0.001 if low == high else high
  powers_U = _powers(base, k)
  keep_U = 1 - np.clip((np.arange(k // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  return 1 / (factor * powers_U) * (1 - keep_U) + 1 / powers_U * keep_U


# Inverse frequencies [K/2] of each model.rope_scaling, float32. The scalings are computed on the
# host, op for op as transformers' ROPE_INIT_FUNCTIONS do in torch (numpy float32 divides exactly;
# XLA:CPU turns x / c into x * (1 / c)): they equal HF's but for an ulp or two where torch's powf
# rounds otherwise. "none" keeps the jnp formula it always had, so models without scaling are
# bitwise unchanged.
FREQUENCIES = {
    "none": lambda c, k: 1.0 / c.rope_theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k),
    "linear": _linear, "llama3": _llama3, "yarn": _yarn}


def attention_factor(c) -> float:
  """What cos and sin are multiplied by: yarn's rope_attention_factor, or 0.1 ln(factor) + 1 when
  that is 0 (Peng et al., 2023; 1 for factor <= 1); 1 for every other scaling."""
  if c.rope_scaling != "yarn":
    return 1.0
  return c.rope_attention_factor or (0.1 * math.log(c.rope_factor) +
                                     1.0 if c.rope_factor > 1 else 1.0)


def rope(x_BLHK, positions_BL, c):
  """Rotary position embedding (Su et al., 2021), in the half-split layout of HF Llama, with the
  rope scaling of the ModelConfig `c` (FREQUENCIES, attention_factor)."""
  inv_freq_U = FREQUENCIES[c.rope_scaling](c, x_BLHK.shape[-1])
  angle_BLU = positions_BL[..., None].astype(jnp.float32) * inv_freq_U
  sin, cos = jnp.sin(angle_BLU)[:, :, None, :], jnp.cos(angle_BLU)[:, :, None, :]
  if (scale := attention_factor(c)) != 1.0:
    sin, cos = sin * scale, cos * scale
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BLHK.dtype)
