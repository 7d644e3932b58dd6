"""Per-device bytes of what one train step holds beside the state, as two phases whose peak is the step's:
the backward pass (gradients, the activations kept under the remat policy, one layer's backward temporaries,
attention scores, the loss's logits) and the optimizer update (gradient, update and moment temporaries of
every parameter together).

Counts are per local token of one microbatch (B_local = batch / data-like ways / microbatches rows of L
tokens) in units of the widths: D + HK (embed, q and attention out), F (mlp hidden), H S (the [B, H, L, S]
scores of the xla implementation; H x block for blockwise and the fused kernels). Which arrays each remat
policy keeps follows jaxtrain/model/transformer.py: SAVED. The scales (SCALE, TRANSIENT, the P and token
factors) are XLA:CPU's buffer assignment, fitted on 24 compiled steps of 2- and 4-layer models and checked
leaving each one out (benchmarks/RESULTS.md, "Planner"): the step memory_analysis() reports. Other backends
fuse more; on them the prediction is an upper bound of the same shape, not a measurement.
"""

import dataclasses
import math

from jaxtrain.config import ModelConfig

F32 = 4

# Arrays of each width saved per layer and token for the backward pass: (D + HK, F, H S).
#   none: x, h, x2, h2 and q, o (4 (D + HK) / 2); gate, up, silu(gate) * up (3 F); scores and probs (2 HS)
#   dots: outputs of matmuls: q, k, v, attention out, o-proj, down-proj (3 (D + HK) / 2), gate, up (2 F), scores
#   full: the layer's input (D + HK) / 2, everything else recomputed in the backward pass
SAVED = {"none": (2.0, 3, 2), "dots": (1.5, 2, 1), "full": (0.5, 0, 0)}
SCALE = {"none": 1.75, "dots": 1.0, "full": 5.0}  # XLA:CPU keeps that many copies (scan stacking, layouts)
# Unrolled layers (scan_layers=False): remat changes nothing on XLA:CPU (nn.remat's prevent_cse=False lets XLA
# merge the recomputation with the forward pass outside a scan; measured: none, dots and full compile to the
# same bytes), so every policy keeps what "none" keeps, UNROLLED times, and the gradient is not stacked.
UNROLLED = 1.25
TRANSIENT = 1.2  # x (3, 3, 3): one layer's backward, its residuals recomputed and their gradients
LOGITS = 1.2  # x [tokens, V] float32: logits and their gradient (full cross-entropy)
GRADS = 2.0  # x params: the gradient and its accumulation (scan stacks the layers' gradients)
GATHERED = 1.0  # x params x (fsdp - 1): the all-gathered weights of the fsdp axis
OPTIMIZER = 4.2  # x params: gradient, update, and the moments' new values before they land in the state
OPTIMIZER_TOKENS = 1.5  # x tokens x D x 4: what of the batch is still alive at the update


@dataclasses.dataclass(frozen=True)
class Widths:
  """Per-device widths of one layer's activations for one token (tensor-parallel splits applied)."""
  d: int  # embed
  f: int  # mlp hidden (dense) or the routed experts' per-token share (top_k x expert hidden, MoE)
  hk: int  # query heads x head dim
  hs: int  # attention scores per token (heads x keys) for the materialized (xla) implementation


def widths(m: ModelConfig, seq_len: int, tensor: int, attention: str) -> Widths:
  """`attention`: the implementation that will run (xla materializes H x S scores per token; the blockwise
  and fused kernels hold H x block)."""
  f = m.top_k * m.expert_d_ff + m.n_shared_experts * m.expert_d_ff if m.n_experts else m.d_ff
  keys = seq_len if attention == "xla" else min(m.attention_block, seq_len)
  return Widths(m.d_model, -(-f // tensor), m.n_heads * m.head_dim // tensor, m.n_heads * keys // tensor)


def scanned(m: ModelConfig) -> bool:
  """Whether the layers run as a loop: a scan of one layer is no loop (XLA removes a trip count of one)."""
  return m.scan_layers and m.n_layers > 1


def backward_bytes(m: ModelConfig, w: Widths, tokens: int, act_bytes: int) -> dict:
  """{"activations", "attention_temps"} of the backward phase for `tokens` local tokens of one microbatch."""
  remat = m.remat if scanned(m) else "none"
  s_d, s_f, s_s = SAVED[remat]
  layers = m.n_layers * (SCALE[remat] if scanned(m) else UNROLLED)
  activations = tokens * act_bytes * ((layers * s_d + 3 * TRANSIENT) * (w.d + w.hk) + (layers * s_f + 3 * TRANSIENT) * w.f)
  scores = tokens * F32 * w.hs * (layers * s_s + 3 * TRANSIENT)
  return {"activations": int(activations), "attention_temps": int(scores)}


def loss_bytes(tokens: int, vocab: int, tensor: int, impl: str, token_chunk: int, vocab_chunk: int) -> int:
  """The [tokens, V] float32 logits and their gradient (full), or one tile of them (chunked, pallas)."""
  v = -(-vocab // tensor)
  if impl != "full":
    tokens, v = min(tokens, token_chunk), min(v, vocab_chunk)
  return int(LOGITS * tokens * v * F32)


def grads_bytes(params_bytes: int, fsdp: int, microbatches: int, loop: bool) -> int:
  grads = GRADS if loop else UNROLLED
  return int(params_bytes * (grads + (microbatches > 1)) + GATHERED * params_bytes * (fsdp - 1))


def optimizer_bytes(params_bytes: int, tokens: int, d_model: int) -> int:
  return int(OPTIMIZER * params_bytes + OPTIMIZER_TOKENS * tokens * d_model * F32)


def microbatch_tokens(batch: int, seq_len: int, data_ways: int, context: int, microbatches: int) -> int:
  return math.ceil(batch / data_ways / microbatches) * seq_len // context
