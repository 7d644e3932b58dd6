"""generate: cache decoding up to max_seq_len equals greedy decoding by full forwards; past it, an error."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.model import ModelConfig, Transformer, generate
from tests.fixtures import tiny_config


@pytest.fixture(scope="module")
def tiny():
  """A tiny untied model with max_seq_len 12, and its params."""
  mc = ModelConfig.from_config(tiny_config(model={"max_seq_len": 12, "tie_embeddings": False}).model)
  model = Transformer(mc)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
  return model, params


def test_greedy_generate_to_max_seq_len_equals_full_forward_argmax(tiny):
  model, params = tiny
  prompt_BP = jax.random.randint(jax.random.key(1), (2, 5), 0, model.cfg.vocab_size)
  got_BN = np.asarray(jax.jit(generate, static_argnums=(0, 4, 5, 6))(model, params, prompt_BP, jax.random.key(2),
                                                                     7, 0.0, 0))
  forward = jax.jit(model.apply)
  seq_BL = np.zeros((2, 12), np.int32)  # causal: the zeros after position i do not change its logits
  seq_BL[:, :5] = prompt_BP
  for i in range(5, 12):  # 5 + 7 = max_seq_len tokens in all
    seq_BL[:, i] = np.argmax(forward({"params": params}, seq_BL)[:, i - 1], -1)
  np.testing.assert_array_equal(got_BN, seq_BL[:, 5:])


@pytest.mark.parametrize("prompt_len, max_new_tokens", [(5, 8), (12, 1), (13, 1)])
def test_generate_past_max_seq_len_is_refused(tiny, prompt_len, max_new_tokens):
  """The cache has max_seq_len positions: beyond them writes wrapped and the logits were silently wrong."""
  model, params = tiny
  prompt_BP = jnp.zeros((1, prompt_len), jnp.int32)
  with pytest.raises(ValueError, match=f"{prompt_len} .*{max_new_tokens} .*max_seq_len=12"):
    generate(model, params, prompt_BP, jax.random.key(0), max_new_tokens, 0.0, 0)


def test_generate_refuses_no_new_tokens(tiny):
  model, params = tiny
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, params, jnp.zeros((1, 3), jnp.int32), jax.random.key(0), 0, 0.0, 0)
