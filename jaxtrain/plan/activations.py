"""Per-device bytes of what one train step holds beside the state, as two phases whose peak is the
step's: the backward pass (gradients, the activations kept under the remat policy, one layer's
backward temporaries, attention scores, the loss's logits) and the optimizer update (gradient,
update and moment temporaries of every parameter together).

Counts are per local token of one microbatch (B_local = batch / data-like ways / microbatches rows
of L tokens) in units of the widths: D + HK (embed, q and attention out), F (mlp hidden), H S (the
[B, H, L, S] scores of the xla implementation; H x block for blockwise and the fused kernels). Which
arrays each remat policy keeps follows jaxtrain/model/transformer.py: SAVED. How many copies of each
a backend holds (Scales): XLA_CPU is XLA:CPU's buffer assignment, fitted on 24 compiled steps of 2-
and 4-layer models and checked leaving each one out (benchmarks/RESULTS.md, "Planner"); XLA_TPU is
the counts with one f32 copy of the logits and two of one MoE layer's dispatch rows, fitted on
steps compiled by XLA:TPU (tests/targets/planner_grid.FIT, MOE_FIT) and checked on the shipped
configs (tests/targets/test_configs.py); BY_COUNT, for GPUs, is the counts themselves, an
estimate not yet checked against a compiled step there.
"""

import dataclasses
import math

from jaxtrain.config import ModelConfig

F32 = 4

# Arrays of each width saved per layer and token for the backward pass: (D + HK, F, H S). none: x,
# h, x2, h2 and q, o (4 (D + HK) / 2); gate, up, silu(gate) * up (3 F); scores and probs (2 HS)
# dots: outputs of matmuls: q, k, v, attention out, o-proj, down-proj (3 (D + HK) / 2), gate, up (2
# F), scores full: the layer's input (D + HK) / 2, everything else recomputed in the backward pass
SAVED = {"none": (2.0, 3, 2), "dots": (1.5, 2, 1), "full": (0.5, 0, 0)}
# MoE dispatch rows (Widths.dispatch) saved per layer: the gathered expert inputs, unless recomputed
SAVED_DISPATCH = {"none": 1, "dots": 1, "full": 0}
# Blockwise attention (kernels/attention/blockwise.py) saves its output and log-sum-exp, no scores:
# what its backward holds is a key block's float32 scores and probabilities. XLA:TPU's peaks of
# long_16k and long_32k (context parallelism; live-range reports, 2026-12-04) hold 2.0 and 1.5
# copies of one block's [L, H x block] float32 scores, in the attention backward's loop.
BLOCK_COPIES = 2


@dataclasses.dataclass(frozen=True)
class Scales:
  """How many copies of each count a backend's buffer assignment holds at the step's peak."""
  saved: dict  # remat policy -> copies of SAVED per layer (scanned layers)
  unrolled: float  # copies of "none"'s SAVED per layer, and of the gradient, for unrolled layers
  # x (3, 3, 3): one layer's backward, its residuals recomputed and their gradients
  transient: float
  logits: float  # x [tokens, V] float32 (full cross-entropy)
  grads: float  # x params: the gradient (and its stacked copy in a scan)
  gathered: float  # x params x (fsdp - 1) x 2 / layers: the all-gathered weights of two layers
  # x params: gradient, update and the moments' new values before they land in the state
  optimizer: float
  optimizer_tokens: float  # x tokens x D x 4: what of the batch is still alive at the update
  dispatch: float = 1.0  # x one MoE layer's dispatch rows (Widths.dispatch) in its backward


# XLA:CPU, fitted on compiled steps. Unrolled layers: remat changes nothing there (nn.remat's
# prevent_cse=False lets XLA merge the recomputation with the forward pass outside a scan; none,
# dots and full compiled to the same bytes), so every policy keeps what "none" keeps.
XLA_CPU = Scales(saved={"none": 1.75, "dots": 1.0, "full": 5.0}, unrolled=1.25, transient=1.2,
                 logits=1.2, grads=2.0, gathered=1.0, optimizer=4.2, optimizer_tokens=1.5)
# GPU: the counts themselves (XLA fuses the elementwise ops and updates the moments in place), not
# yet checked against a compiled step there; remat is assumed to take effect.
BY_COUNT = Scales(saved={"none": 1.0, "dots": 1.0, "full": 1.0}, unrolled=1.0, transient=1.0,
                  logits=2.0, grads=1.0, gathered=1.0, optimizer=2.0, optimizer_tokens=0.0)
# XLA:TPU, fitted on gpt2_small and llama_1b steps on a 4-chip v5p slice (each remat policy, data
# and fsdp, batches of 16-32; benchmarks/RESULTS.md, "Planner on TPU"): the counts, but the logits'
# gradient takes the logits' own buffer (one f32 [tokens, V] copy, not two). With two, the five
# steps were over-predicted by 9-64%; with one, by -4% to +15%.
# MoE (tests/targets/planner_grid.MOE_FIT, remat full): one layer's backward holds the dispatch rows
# and their gradients (dispatch 2.0); 0.97-1.08 on those two, mixtral_8x7b 0.91 out of sample. Under
# remat none the one MoE step compiled needed 1.4x the prediction: not modelled (`plan` says so).
XLA_TPU = dataclasses.replace(BY_COUNT, logits=1.0, dispatch=2.0)


@dataclasses.dataclass(frozen=True)
class Widths:
  """Per-device widths of one layer's activations for one token (tensor-parallel splits applied)."""
  d: int  # embed
  f: int  # mlp hidden (dense), or every expert row a token's dispatch holds x expert hidden (MoE)
  hk: int  # query heads x head dim
  hs: int  # attention scores per token (heads x keys) for the materialized (xla) implementation
  dispatch: int = 0  # MoE: [*, D] rows per token the dispatch holds (see expert_rows) x D
  blockwise: bool = False  # blockwise attention: no scores saved, BLOCK_COPIES of a block's held


def expert_rows(m: ModelConfig, expert_shards: int) -> tuple[float, int]:
  """(expert rows per local token, token copies per local token) of one MoE layer's dispatch
  (jaxtrain/model/moe.py). Dropless over X expert shards sends every token to every shard (X
  copies) and sizes the grouped matmul for the worst case, X x min(k, E / X) rows a token; capacity
  holds capacity_factor x k slots a token, whatever the shards, and sends those slots themselves."""
  if m.dispatch == "capacity":
    return m.capacity_factor * m.top_k, 0
  x = expert_shards
  return x * min(m.top_k, m.n_experts // x), x


def widths(m: ModelConfig, seq_len: int, tensor: int, attention: str,
           expert_shards: int = 1) -> Widths:
  """`attention`: the implementation that will run (xla materializes H x S scores per token; the
  blockwise and fused kernels hold H x block). MoE layers: the expert rows of `expert_rows` (their
  hidden width the largest a layer holds: the first dense layers' d_ff if wider)."""
  keys = seq_len if attention == "xla" else min(m.attention_block, seq_len)
  f, dispatch = m.d_ff, 0
  if m.n_experts:
    rows, copies = expert_rows(m, expert_shards)
    f = int((rows + m.n_shared_experts) * m.expert_d_ff)
    f = max(f, m.d_ff) if m.moe_first_dense else f
    dispatch = int((copies + rows) * m.d_model)
  return Widths(m.d_model, -(-f // tensor), m.n_heads * m.head_dim // tensor,
                m.n_heads * keys // tensor, dispatch, attention == "blockwise")


def scanned(m: ModelConfig) -> bool:
  """Whether the layers run as a loop: a scan of one layer is no loop
  (XLA removes a trip count of one)."""
  return m.scan_layers and m.n_layers > 1


def backward_bytes(m: ModelConfig, w: Widths, tokens: int, act_bytes: int, k: Scales) -> dict:
  """{"activations", "attention_temps"} of the backward phase for `tokens` local tokens of one
  microbatch."""
  remat = m.remat if scanned(m) or k is not XLA_CPU else "none"
  s_d, s_f, s_s = SAVED[remat]
  layers = m.n_layers * (k.saved[remat] if scanned(m) or k is not XLA_CPU else k.unrolled)
  t = 3 * k.transient
  dispatch = layers * SAVED_DISPATCH[remat] + k.dispatch
  activations = tokens * act_bytes * ((layers * s_d + t) * (w.d + w.hk) + (layers * s_f + t) * w.f
                                      + dispatch * w.dispatch)
  scores = tokens * F32 * w.hs * (BLOCK_COPIES if w.blockwise else layers * s_s + t)
  return {"activations": int(activations), "attention_temps": int(scores)}


def loss_bytes(tokens: int, vocab: int, tensor: int, impl: str, token_chunk: int, vocab_chunk: int,
               k: Scales) -> int:
  """The [tokens, V] float32 logits and their gradient (full), or one tile of them
  (chunked, pallas)."""
  v = -(-vocab // tensor)
  if impl != "full":
    tokens, v = min(tokens, token_chunk), min(v, vocab_chunk)
  return int(k.logits * tokens * v * F32)


def grads_bytes(params_bytes: int, fsdp: int, m: ModelConfig, microbatches: int, k: Scales) -> int:
  grads = k.grads if scanned(m) or k is not XLA_CPU else k.unrolled
  gathered = k.gathered * params_bytes * (fsdp - 1) * min(m.n_layers, 2) / m.n_layers
  return int(params_bytes * (grads + (microbatches > 1)) + gathered)


def optimizer_bytes(params_bytes: int, tokens: int, d_model: int, k: Scales) -> int:
  return int(k.optimizer * params_bytes + k.optimizer_tokens * tokens * d_model * F32)


def microbatch_tokens(batch: int, seq_len: int, data_ways: int, context: int,
                      microbatches: int) -> int:
  return math.ceil(batch / data_ways / microbatches) * seq_len // context
