"""The encoder (model.arch=encoder): bidirectional attention within a document only, every
attention implementation against the reference's non-causal mask, packed documents independent,
parameter count by formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ModelConfig
from jaxtrain.kernels.attention import reference
from jaxtrain.model import Encoder, param_count
from jaxtrain.model.attention import attend

SMALL = ModelConfig(arch="encoder", positions="learned", vocab_size=32, d_model=16, n_layers=2,
                    n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24, max_seq_len=16)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_bidirectional_attend_equals_the_reference_without_causal_order(impl):
  b, l, h, g, k = 2, 12, 4, 2, 8
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, l, h, k))
  kv = [jax.random.normal(key, (b, l, g, k)) for key in keys[1:]]
  segment = jnp.array([[1] * 5 + [2] * 6 + [0], [1] * 12])
  cfg = ModelConfig(attention=impl, attention_block=4)
  got = attend(q, *kv, segment, segment, None, None, cfg, causal=False)
  index = jnp.broadcast_to(jnp.arange(l), (b, l))
  want = reference.attention(q, *kv, segment, segment, index, index, causal=False)
  valid = (segment > 0)[..., None, None]
  np.testing.assert_allclose(jnp.where(valid, got, 0), want, atol=1e-5)
  causal = reference.attention(q, *kv, segment, segment, index, index)
  assert np.abs(np.asarray(want - causal)).max() > 1e-2  # later keys do count


def test_reference_mask_without_causal_order_is_the_document_mask():
  segment = jnp.array([[1, 1, 2, 2, 0]])
  index = jnp.arange(5)[None]
  got = reference.mask(segment, segment, index, index, causal=False)[0]
  want = (segment[0][:, None] == segment[0][None, :]) & (segment[0][None, :] > 0)
  np.testing.assert_array_equal(got, want)


def test_packed_documents_do_not_see_each_other_and_a_token_sees_both_sides():
  model = Encoder(SMALL)
  tokens = jnp.array([[3, 4, 5, 6, 7, 8, 9, 10]])
  segment = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2]])
  positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3]])
  params = model.init(jax.random.key(0), tokens)["params"]
  run = lambda t: model.apply({"params": params}, t, positions, segment)  # noqa: E731
  base = run(tokens)
  other_doc = run(tokens.at[0, 6].set(20))
  np.testing.assert_allclose(other_doc[0, :4], base[0, :4], atol=1e-6)  # document 1 unchanged
  later = run(tokens.at[0, 3].set(20))
  assert np.abs(np.asarray(later[0, 0] - base[0, 0])).max() > 1e-4  # token 0 sees token 3


@pytest.mark.parametrize("positions, types", [("learned", 2), ("rope", 0)])
def test_param_count_is_the_encoders_tree(positions, types):
  cfg = ModelConfig(**{**SMALL.__dict__, "positions": positions, "type_vocab_size": types})
  tree = jax.eval_shape(Encoder(cfg).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)) == param_count(cfg)
