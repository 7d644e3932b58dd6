"""Per-device bytes of what one train step holds beside the state: gradients, the activations kept for the
backward pass under the remat policy, attention and loss temporaries, and the optimizer's update buffers.

Counts are per local token of one microbatch (B_local = batch / data-like ways / microbatches rows of L
tokens), in units of the model's widths: D (embed), F (mlp), Q = (H + 2G) K (q, k, v), H K, and the
attention scores H S per token. Which arrays each remat policy keeps follows jaxtrain/model/transformer.py
(none: every residual jax's autodiff saves; dots: the outputs of matmuls, jax.checkpoint_policies.dots_saveable;
full: the layer's input only, everything else recomputed in the backward pass). The coefficients below are
those counts, checked (not fitted per case) against XLA:CPU's buffer assignment: benchmarks/RESULTS.md, "Planner".
"""

import dataclasses
import math

from jaxtrain.config import ModelConfig

F32 = 4


@dataclasses.dataclass(frozen=True)
class Widths:
  """Per-device widths of one layer's activations for one token (tensor-parallel splits applied)."""
  d: int  # embed
  f: int  # mlp hidden (dense) or the routed experts' per-token share (top_k x expert hidden, MoE)
  hk: int  # query heads x head dim
  gk: int  # kv heads x head dim
  hs: int  # attention scores per token (heads x keys) for the materialized (xla) implementation


# Arrays of each width saved per layer and token for the backward pass, by remat policy.
#   none: x, h (attn_norm out), x2, h2 (4 D); q, o, and k, v repeated to every head (4 HK); k, v (2 GK);
#         probs and the masked scores (2 HS); gate, up, silu(gate) * up (3 F)
#   dots: outputs of matmuls: q, k, v (HK + 2 GK), scores (HS), attention out (HK), o-proj and down-proj out
#         and the layer input (3 D), gate and up (2 F)
#   full: the layer's input (D)
SAVED = {
    "none": {"d": 4, "hk": 4, "gk": 2, "hs": 2, "f": 3},
    "dots": {"d": 3, "hk": 2, "gk": 2, "hs": 1, "f": 2},
    "full": {"d": 1, "hk": 0, "gk": 0, "hs": 0, "f": 0},
}
# The backward pass of one layer at a time: its residuals (recomputed under remat) and their gradients live.
TRANSIENT = {"d": 6, "hk": 6, "gk": 4, "hs": 3, "f": 5}


def widths(m: ModelConfig, seq_len: int, tensor: int, attention: str) -> Widths:
  """`attention`: the implementation that will run (xla materializes H x S scores per token; the blockwise
  and fused kernels hold H x block)."""
  f = m.top_k * m.expert_d_ff + m.n_shared_experts * m.expert_d_ff if m.n_experts else m.d_ff
  keys = seq_len if attention == "xla" else min(m.attention_block, seq_len)
  return Widths(m.d_model, -(-f // tensor), m.n_heads * m.head_dim // tensor,
                m.n_kv_heads * m.head_dim // tensor, m.n_heads * keys // tensor)


def per_token(counts: dict, w: Widths) -> int:
  return sum(counts[k] * getattr(w, k) for k in counts)


def activation_bytes(m: ModelConfig, w: Widths, tokens: int, remat: str, act_bytes: int) -> dict:
  """{"activations", "attention_temps"} for `tokens` local tokens of one microbatch: saved residuals of
  every layer, and the one layer whose backward runs (its scores counted as attention temporaries)."""
  saved = SAVED[remat]
  layer = per_token({k: v for k, v in saved.items() if k != "hs"}, w)
  transient = per_token({k: v for k, v in TRANSIENT.items() if k != "hs"}, w)
  activations = tokens * act_bytes * (m.n_layers * layer + transient)
  scores = tokens * F32 * w.hs * (m.n_layers * saved["hs"] + TRANSIENT["hs"])
  return {"activations": activations, "attention_temps": scores}


def loss_bytes(tokens: int, vocab: int, tensor: int, impl: str, token_chunk: int, vocab_chunk: int) -> int:
  """The [tokens, V] float32 logits and their gradient (full), or one tile of them (chunked, pallas)."""
  v = -(-vocab // tensor)
  if impl == "full":
    return 2 * tokens * v * F32
  return 2 * min(tokens, token_chunk) * min(v, vocab_chunk) * F32


def optimizer_temp_bytes(params_bytes: int, name: str) -> int:
  """The gradient (float32, sharded like the params) and the optimizer's update buffers."""
  extra = {"adamw": 1.0, "muon": 2.0}[name]
  return int(params_bytes * (1 + extra))


def microbatch_tokens(batch: int, seq_len: int, data_ways: int, context: int, microbatches: int) -> int:
  return math.ceil(batch / data_ways / microbatches) * seq_len // context
