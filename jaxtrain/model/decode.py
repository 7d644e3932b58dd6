"""Autoregressive sampling with the KV cache: prefill the prompt once, then one token per step."""

import jax
import jax.numpy as jnp

from jaxtrain.model.transformer import Transformer


def init_cache(model: Transformer, batch_size: int):
  """Zeroed KV cache for `batch_size` rows of up to max_seq_len tokens (shapes via eval_shape)."""
  decoder = model.clone(decode=True)
  tokens = jnp.zeros((batch_size, model.cfg.max_seq_len), jnp.int32)
  shapes = jax.eval_shape(decoder.init, jax.random.key(0), tokens)["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decode_logits(model: Transformer, params, cache, tokens_BL, start, extra=None, pad_B=None):
  """Logits of `tokens_BL` placed at cache slots start.., attending to the cache; returns new cache.
  `extra`: the model's non-trainable collections (e.g. MoE expert biases), if it has any. `pad_B`:
  left padding, the number of pad slots at the start of each row (None: none): slots before it are
  masked out of attention and each row's positions count from its first real token."""
  decoder = model.clone(decode=True)
  slots_BL = start + jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
  positions_BL, segment_ids_BL = slots_BL, None
  if pad_B is not None:
    positions_BL = jnp.maximum(slots_BL - pad_B[:, None], 0)
    segment_ids_BL = (slots_BL >= pad_B[:, None]).astype(jnp.int32)
  logits_BLV, updated = decoder.apply({"params": params, "cache": cache, **(extra or {})},
                                      tokens_BL, positions_BL, segment_ids_BL, mutable=["cache"])
  return logits_BLV, updated["cache"]


def sample_token(logits_BV, rng, temperature: float, top_k: int):
  """Greedy when temperature == 0; else softmax(logits / T) over the top k (all when k == 0)."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_k > 0:
    kth_BV = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_BV, -jnp.inf, logits_BV)
  return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


def generate(model: Transformer, params, prompt_BL, rng, max_new_tokens: int, temperature: float,
             top_k: int, extra=None):
  """Prompt [B, P] -> new tokens [B, max_new_tokens]. Pure; jit it with the sampling args static.
  ValueError when P + max_new_tokens exceeds max_seq_len (the cache's positions)."""
  b, p = prompt_BL.shape
  if max_new_tokens < 1:
    raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
  if p + max_new_tokens > model.cfg.max_seq_len:
    raise ValueError(
        f"generate: prompt length {p} + max_new_tokens {max_new_tokens} = {p + max_new_tokens} "
        f"exceeds max_seq_len={model.cfg.max_seq_len}")
  logits_BLV, cache = decode_logits(model, params, init_cache(model, b), prompt_BL, 0, extra)
  first_B = sample_token(logits_BLV[:, -1], jax.random.fold_in(rng, 0), temperature, top_k)

  def step(carry, i):
    token_B, cache = carry
    logits_B1V, cache = decode_logits(model, params, cache, token_B[:, None], p + i, extra)
    nxt_B = sample_token(logits_B1V[:, 0], jax.random.fold_in(rng, i + 1), temperature, top_k)
    return (nxt_B, cache), token_B

  (last_B, _), tokens_NB = jax.lax.scan(step, (first_B, cache), jnp.arange(max_new_tokens - 1))
  return jnp.concatenate([tokens_NB.T, last_B[:, None]], axis=1)
