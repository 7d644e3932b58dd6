"""The definition flash_attention is held to: attention's plain-jnp reference, re-exported beside
kernel and ops."""

from jaxtrain.kernels.attention.reference import attention, mask

__all__ = ["attention", "mask"]
