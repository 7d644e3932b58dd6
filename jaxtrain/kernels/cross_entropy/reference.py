"""Cross-entropy (+ z-loss) of the output projection, in plain jnp: the definition the chunked and
Pallas implementations are held to. It materializes the [N, V] float32 logits, exactly as the
Transformer's unfused head and core/lm.py's cross_entropy do.

Shapes (jaxtrain/model/axes.py): x [N, D] final hidden states (N tokens), w [D, V] (`unembed_DV`) or
[V, D] (tied `embed_VD`, `w_layout="VD"`), targets [N] int, mask [N] float32 (0 = not counted).
"""

import jax
import jax.numpy as jnp


def logits(x_ND, w, w_layout: str = "DV"):
  """float32 [N, V]: the model head's einsum (x and w in the compute dtype,
  accumulated in float32)."""
  spec = "ND,DV->NV" if w_layout == "DV" else "ND,VD->NV"
  return jnp.einsum(spec, x_ND, w.astype(x_ND.dtype), preferred_element_type=jnp.float32)


def cross_entropy(x_ND, w, targets_N, mask_N, z_loss: float, w_layout: str = "DV"):
  """Sums over tokens: (ce, z, tokens), z = z_loss * sum(logsumexp^2) (PaLM's z-loss)."""
  logits_NV = logits(x_ND, w, w_layout)
  lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
  target_N = jnp.take_along_axis(logits_NV, targets_N[:, None], axis=-1)[:, 0]
  ce = jnp.sum((lse_N - target_N) * mask_N)
  z = z_loss * jnp.sum(jnp.square(lse_N) * mask_N)
  return ce, z, jnp.sum(mask_N)
