"""What might close jaxtrain's CPU gap to torch eager: each try is jaxtrain's step built another
way, timed interleaved with torch eager and the unchanged jaxtrain step (vs_torch.py --tries a,b).

A try is (config overrides, XLA compiler options, patches of jaxtrain in force while its step is
traced). Every try's step is compiled ahead of time, with its XLA:CPU debug options if any (one
process, no XLA_FLAGS); a patch stands for a change to jaxtrain itself that would be made there.
"""

import contextlib
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain.model import attention, axes, dense, transformer
from jaxtrain.model import mlp as mlp_lib
from jaxtrain.model.layers import param

YNN_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}  # XLA's own (Eigen) dots and loops
EIGEN_1_THREAD = {**YNN_OFF, "xla_cpu_multi_thread_eigen": False}  # and those dots on one thread


class FusedGateUpMlp(mlp_lib.Mlp):
  """Mlp with one [D, 2F] matmul for gate and up (torch's gate_up Linear) instead of two [D, F]
  ones; the same parameters, concatenated in the step."""

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    pd, cd = c.param_dtype, c.compute_dtype
    out_std = c.init_std / (2 * c.n_layers) ** 0.5
    embed_mlp = (axes.EMBED, axes.MLP)
    w_gate = param(self, "gate", (c.d_model, c.d_ff), embed_mlp, pd, c.init_std)
    w_up = param(self, "up", (c.d_model, c.d_ff), embed_mlp, pd, c.init_std)
    w_down = param(self, "down", (c.d_ff, c.d_model), (axes.MLP, axes.EMBED), pd, out_std)
    w_DF2 = jnp.concatenate([w_gate, w_up], axis=1).astype(cd)
    gate_BLF, up_BLF = jnp.split(jnp.einsum("BLD,DF->BLF", x_BLD.astype(cd), w_DF2), 2, axis=-1)
    return jnp.einsum("BLF,FD->BLD", jax.nn.silu(gate_BLF) * up_BLF, w_down.astype(cd))


def dot_product_attention_vjp(q_BLHK, k_BSGK, v_BSGK, mask_BLS):
  """attention.dot_product_attention with both einsums through dense.einsum_vjp."""
  r = q_BLHK.shape[2] // k_BSGK.shape[2]
  k_BSHK, v_BSHK = jnp.repeat(k_BSGK, r, axis=2), jnp.repeat(v_BSGK, r, axis=2)
  scale = 1.0 / jnp.sqrt(q_BLHK.shape[-1]).astype(jnp.float32)
  scores_BHLS = dense.einsum_vjp("BLHK,BSHK->BHLS", q_BLHK, k_BSHK) * scale
  scores_BHLS = jnp.where(mask_BLS[:, None], scores_BHLS, attention.NEG_INF)
  probs_BHLS = jax.nn.softmax(scores_BHLS, axis=-1).astype(v_BSHK.dtype)
  return dense.einsum_vjp("BHLS,BSHK->BLHK", probs_BHLS, v_BSHK)


# The patches: each a change to jaxtrain itself, in force while a try's step is traced.
def fused_gate_up():
  return mock.patch.object(transformer, "Mlp", FusedGateUpMlp)


def attention_einsum_vjp():
  return mock.patch.object(attention, "dot_product_attention", dot_product_attention_vjp)


# name -> (config overrides {section: {key: value}}, XLA compiler options, patches)
TRIES = {
    "aot": ({}, {}, ()),  # control: compiled ahead of time, no option
    "ynn_off": ({}, YNN_OFF, ()),
    "ynn_dots_only": ({}, {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}, ()),
    "fast_math": ({}, {"xla_cpu_enable_fast_math": True}, ()),
    "concurrency_scheduler": (
        {}, {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}, ()),
    "memory_scheduler": ({}, {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
                         ()),
    "eigen_1_thread": ({}, EIGEN_1_THREAD, ()),
    "no_fusion_emitters": ({}, {"xla_cpu_use_fusion_emitters": False}, ()),
    "scan_layers": ({"model": {"scan_layers": True}}, {}, ()),
    "fused_norm_xla": ({"model": {"fused_norm": "xla"}}, {}, ()),
    "ce_chunked": ({"train": {"cross_entropy": "chunked"}}, {}, ()),
    "no_skip_nonfinite": ({"optim": {"skip_nonfinite": False}}, {}, ()),
    "fused_gate_up": ({}, {}, (fused_gate_up,)),
    # the two changes of 2026-12-07, now CPU's defaults (model.projection_vjp "einsum", attention
    # "xla_causal"; before: the tries "einsum_vjp" and "attention_causal_chunks"), each undone
    "projection_vjp_jax": ({"model": {"projection_vjp": "jax"}}, {}, ()),
    "attention_xla": ({"model": {"attention": "xla"}}, {}, ()),
    "before": ({"model": {"projection_vjp": "jax", "attention": "xla"}}, {}, ()),
    "einsum_vjp_all": ({}, {}, (attention_einsum_vjp,)),  # the attention core's einsums too
}


def build(name: str, make_cfg, jaxtrain_cls):
  """The trainer of try `name`: `jaxtrain_cls(cfg, name, options)` on small_20m with its overrides,
  built (and traced) inside its patches."""
  overrides, options, patches = TRIES[name]
  cfg = make_cfg()
  for section, values in overrides.items():
    cfg[section].update(**values)
  with contextlib.ExitStack() as stack:
    for patch in patches:
      stack.enter_context(patch())
    return jaxtrain_cls(cfg, name, options)
