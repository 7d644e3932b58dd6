"""Rollouts for RL post-training: batched sampling with the KV cache (jaxtrain/model/decode.py),
pure, to be jitted at the composition root with the sampling settings static (`STATIC_ARGNAMES`).

Prompts are left-padded: [B, P] right-aligned, row b's prompt in its last prompt_lens_B[b] slots.
Pad slots are masked out of attention and each row's positions count from its first real token, so a
row's tokens are those of its prompt alone (`left_pad` turns right-padded prompts into this layout).

Under a mesh (`jax.set_mesh` and the logical-axis rules) the params are used as they are sharded for
the policy (no copy), and the batch follows the data axes: rows must divide over them.

Shapes: _BP prompts, _BN generated tokens, _BL prompt and response together (L = P + N).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.model.decode import decode_logits, init_cache
from jaxtrain.posttrain.rl import token_logprobs

STATIC_ARGNAMES = ("model", "max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens",
                   "pad_id")


class Rollout(NamedTuple):
  """tokens_BN: generated tokens, pad_id after a row's first stop token; logp_BN: their sampling
  log-probs (0 where masked); mask_BN: 1.0 on the response (up to and with the first stop token);
  lengths_B."""
  tokens_BN: jax.Array
  logp_BN: jax.Array
  mask_BN: jax.Array
  lengths_B: jax.Array


def filter_logits(logits_BV, top_k: int, top_p: float):
  """-inf outside the top_k largest (0: all) and outside the nucleus: the fewest most likely tokens
  whose probability reaches top_p (1.0: all; Holtzman et al., 2020). The most likely token is always
  kept."""
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # probability mass of the more likely tokens
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    threshold_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
  return logits_BV


def sample(logits_BV, rng, temperature: float, top_k: int, top_p: float):
  """(token_B, logp_B): greedy when temperature == 0, else a draw from softmax(logits / T) filtered
  by top-k and top-p. logp is the token's log-probability under the distribution it was drawn from:
  log softmax of the filtered logits / T, renormalized over the kept tokens (T == 0: log softmax of
  the logits). A PPO/GRPO loss recomputes it from the policy's logits with rl.sampled_logprobs
  (top-k; RL refuses top-p, whose nucleus the loss does not rebuild)."""
  logits_BV = logits_BV.astype(jnp.float32)
  if temperature > 0:
    logits_BV = filter_logits(logits_BV / temperature, top_k, top_p)
    token_B = jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)
  else:
    token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return token_B, token_logprobs(logits_BV, token_B)


def finish(tokens_BN, logp_BN, stop_tokens: tuple, pad_id: int) -> Rollout:
  """Cuts each row after its first stop token (kept):
  later tokens become pad_id with logp 0, masked."""
  is_stop_BN = (jnp.isin(tokens_BN, jnp.asarray(stop_tokens, jnp.int32)) if stop_tokens
                else jnp.zeros(tokens_BN.shape, bool))
  stopped_before_BN = (jnp.cumsum(is_stop_BN, axis=1) - is_stop_BN) > 0
  mask_BN = (~stopped_before_BN).astype(jnp.float32)
  return Rollout(jnp.where(stopped_before_BN, pad_id, tokens_BN),
                 jnp.where(stopped_before_BN, 0.0, logp_BN), mask_BN,
                 jnp.sum(mask_BN, axis=1).astype(jnp.int32))


def check_lengths(model, prompt_width: int, max_new_tokens: int) -> None:
  """ValueError when the prompt width + max_new_tokens exceeds the cache's max_seq_len positions."""
  if max_new_tokens < 1:
    raise ValueError(f"rollout: max_new_tokens must be >= 1, got {max_new_tokens}")
  if prompt_width + max_new_tokens > model.cfg.max_seq_len:
    raise ValueError(
        f"rollout: prompt width {prompt_width} + max_new_tokens {max_new_tokens} exceeds "
        f"max_seq_len={model.cfg.max_seq_len}")


def rollout(model, params, prompts_BP, prompt_lens_B, rng, max_new_tokens: int,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_tokens: tuple = (),
            pad_id: int = 0, extra=None) -> Rollout:
  """Samples max_new_tokens after each left-padded prompt with the KV cache: one prefill, then one
  token per step (lax.scan). The key of token i is fold_in(rng, i), shared by the rows (each row
  draws its own noise). Rows keep sampling after their stop token; `finish` masks what follows
  it."""
  b, p = prompts_BP.shape
  check_lengths(model, p, max_new_tokens)
  # a cache of the P + N slots this rollout fills, not max_seq_len: each step attends over fewer
  # keys
  model = model.clone(cfg=dataclasses.replace(model.cfg, max_seq_len=p + max_new_tokens))
  pad_B = p - prompt_lens_B.astype(jnp.int32)
  logits_BPV, cache = decode_logits(model, params, init_cache(model, b), prompts_BP, 0, extra,
                                    pad_B)
  first = sample(logits_BPV[:, -1], jax.random.fold_in(rng, 0), temperature, top_k, top_p)

  def step(carry, i):
    (token_B, logp_B), cache = carry
    logits_B1V, cache = decode_logits(model, params, cache, token_B[:, None], p + i, extra, pad_B)
    nxt = sample(logits_B1V[:, 0], jax.random.fold_in(rng, i + 1), temperature, top_k, top_p)
    return (nxt, cache), (token_B, logp_B)

  ((last_B, last_logp_B), _), (tokens_NB, logp_NB) = jax.lax.scan(step, (first, cache),
                                                                  jnp.arange(max_new_tokens - 1))
  tokens_BN = jnp.concatenate([tokens_NB.T, last_B[:, None]], axis=1)
  logp_BN = jnp.concatenate([logp_NB.T, last_logp_B[:, None]], axis=1)
  return finish(tokens_BN, logp_BN, stop_tokens, pad_id)


def sequence_inputs(prompts_BP, prompt_lens_B, tokens_BN):
  """The model's inputs for prompt and response together, as the policy sees them in training:
  (tokens_BL, positions_BL, segment_ids_BL) with the prompt's left padding masked (segment 0)."""
  b, p = prompts_BP.shape
  tokens_BL = jnp.concatenate([prompts_BP, tokens_BN], axis=1)
  slots_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
  pad_B1 = (p - prompt_lens_B.astype(jnp.int32))[:, None]
  return tokens_BL, jnp.maximum(slots_BL - pad_B1, 0), (slots_BL >= pad_B1).astype(jnp.int32)


def response_logits(logits_BLV, prompt_width: int, max_new_tokens: int):
  """The logits that predict the response tokens: positions P - 1 .. P + N - 2, [B, N, V]."""
  return logits_BLV[:, prompt_width - 1:prompt_width - 1 + max_new_tokens]


def naive_rollout(model, params, prompts_BP, prompt_lens_B, rng, max_new_tokens: int,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  stop_tokens: tuple = (), pad_id: int = 0, extra=None) -> Rollout:
  """`rollout` without the KV cache, the baseline: every step runs the full forward over a fixed [B,
  P + N] buffer (causal: the slots not yet written do not change earlier logits). Same keys, same
  draws."""
  b, p = prompts_BP.shape
  check_lengths(model, p, max_new_tokens)
  buffer_BL, positions_BL, segment_ids_BL = sequence_inputs(
      prompts_BP, prompt_lens_B, jnp.full((b, max_new_tokens), pad_id, prompts_BP.dtype))
  variables = {"params": params, **(extra or {})}

  def step(buffer_BL, i):
    logits_BLV = model.apply(variables, buffer_BL, positions_BL, segment_ids_BL)
    token_B, logp_B = sample(
        jax.lax.dynamic_index_in_dim(logits_BLV, p + i - 1, axis=1, keepdims=False),
        jax.random.fold_in(rng, i), temperature, top_k, top_p)
    return jax.lax.dynamic_update_index_in_dim(buffer_BL, token_B.astype(buffer_BL.dtype), p + i,
                                               axis=1), logp_B

  buffer_BL, logp_NB = jax.lax.scan(step, buffer_BL, jnp.arange(max_new_tokens))
  return finish(buffer_BL[:, p:], logp_NB.T, stop_tokens, pad_id)


def repeat_groups(prompts_BP, prompt_lens_B, group_size: int):
  """Each prompt repeated group_size times in consecutive rows ([B * G, P], [B * G]) for GRPO: the
  rows draw different noise, so a group holds G samples; row r belongs to prompt r // G."""
  return jnp.repeat(prompts_BP, group_size, axis=0), jnp.repeat(prompt_lens_B, group_size, axis=0)


def left_pad(prompts_BP, prompt_lens_B, pad_id: int = 0):
  """Right-padded prompts (row b's prompt in its first prompt_lens_B[b] slots) -> left-padded."""
  p = prompts_BP.shape[1]
  shift_B = p - prompt_lens_B.astype(jnp.int32)
  src_BP = jnp.arange(p)[None, :] - shift_B[:, None]
  return jnp.where(src_BP >= 0, jnp.take_along_axis(prompts_BP, jnp.maximum(src_BP, 0), axis=1),
                   pad_id)
