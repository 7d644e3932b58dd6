"""SwiGLU feed-forward block (Shazeer, 2020)."""

import flax.linen as nn
import jax

from jaxtrain.collectives import constrain
from jaxtrain.model import axes, dense
from jaxtrain.model.layers import param


class Mlp(nn.Module):
  cfg: "ModelConfig"  # noqa: F821 (jaxtrain.model.transformer.ModelConfig)

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    pd, cd = c.param_dtype, c.compute_dtype
    out_std = c.init_std / (2 * c.n_layers) ** 0.5
    w_gate = param(self, "gate", (c.d_model, c.d_ff), (axes.EMBED, axes.MLP), pd, c.init_std)
    w_up = param(self, "up", (c.d_model, c.d_ff), (axes.EMBED, axes.MLP), pd, c.init_std)
    w_down = param(self, "down", (c.d_ff, c.d_model), (axes.MLP, axes.EMBED), pd, out_std)
    x_BLD = x_BLD.astype(cd)
    gate_BLF = dense.einsum("BLD,DF->BLF", x_BLD, w_gate.astype(cd), c)
    up_BLF = dense.einsum("BLD,DF->BLF", x_BLD, w_up.astype(cd), c)
    h_BLF = constrain(jax.nn.silu(gate_BLF) * up_BLF, (axes.BATCH, axes.SEQ, axes.MLP))
    return dense.einsum("BLF,FD->BLD", h_BLF, w_down.astype(cd), c)
