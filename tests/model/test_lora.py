"""LoRA's pure functions: which weights a pattern names, adapters shaped and named after their
weight (scanned layers and experts as batch axes), and the merge against a numpy reference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.model import ModelConfig, Transformer, lora


def boxed_params(**model):
  """The tiny model's params' shapes, boxed with their logical names."""
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64, max_seq_len=32, **model)
  tokens = jnp.zeros((1, 8), jnp.int32)
  return jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]


def at(tree, name: str):
  for key in name.split("/"):
    tree = tree[key]
  return tree


def test_targets_by_full_match_of_known_kinds():
  params = boxed_params()
  assert lora.targets(params, r".*attn/(q|v)") == ["layers/attn/q", "layers/attn/v"]
  assert lora.targets(params, r"layers/mlp/.*") == ["layers/mlp/down", "layers/mlp/gate",
                                                     "layers/mlp/up"]
  # a full match: "q" alone names nothing; norm scales are no known kind
  assert lora.targets(params, "q") == [] and lora.targets(params, ".*norm.*") == []
  assert lora.targets(params, "embed|layers/attn/o") == ["embed", "layers/attn/o"]


def test_adapters_take_the_weights_logical_names_and_batch_axes():
  params = boxed_params(n_experts=4, top_k=2, d_ff_expert=16)
  names = lora.targets(params, r".*(attn/o|moe/down)")
  adapters = lora.init(jax.random.key(1), params, names, rank=3)
  got = {n: {k: (v.value.shape, v.names) for k, v in at(adapters, n).items()}
         for n in names}
  assert got["layers/attn/o"] == {  # [Z, H, K, D]: two input axes
      "a": ((2, 4, 8, 3), ("layers", "heads", "head_dim", None)),
      "b": ((2, 3, 32), ("layers", None, "embed"))}
  assert got["layers/moe/down"] == {  # [Z, E, F, D]: experts are a batch axis
      "a": ((2, 4, 16, 3), ("layers", "expert", "mlp", None)),
      "b": ((2, 4, 3, 32), ("layers", "expert", None, "embed"))}
  a = np.asarray(nn.unbox(adapters)["layers"]["attn"]["o"]["a"])
  bound = 1 / np.sqrt(4 * 8)  # fan in: H x K
  assert 0.9 * bound < np.abs(a).max() <= bound and not nn.unbox(adapters)["layers"]["attn"]["o"][
      "b"].any()


def test_merge_with_zero_b_is_the_base_bitwise_and_otherwise_w_plus_scaled_ab():
  rng = np.random.default_rng(0)
  base = jax.tree.map(lambda x: rng.normal(0, 0.02, x.shape).astype(np.float32),
                      nn.unbox(boxed_params()))
  names = lora.targets(base, r".*attn/(q|o)|.*mlp/up")
  adapters = nn.unbox(lora.init(jax.random.key(1), base, names, rank=4))
  merged = lora.merge(base, adapters, alpha=8.0, rank=4)
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(merged)):
    assert x.dtype == y.dtype and np.array_equal(x, y)
  adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape),
                          adapters)
  merged = lora.merge(base, adapters, alpha=8.0, rank=4)
  ad = adapters["layers"]
  want = {  # per layer z: W_z + 2 * A_z @ B_z, the input and output axes flattened
      "q": np.einsum("zdr,zrhk->zdhk", ad["attn"]["q"]["a"], ad["attn"]["q"]["b"]),
      "o": np.einsum("zhkr,zrd->zhkd", ad["attn"]["o"]["a"], ad["attn"]["o"]["b"]),
      "up": np.einsum("zdr,zrf->zdf", ad["mlp"]["up"]["a"], ad["mlp"]["up"]["b"])}
  got = {"q": merged["layers"]["attn"]["q"] - base["layers"]["attn"]["q"],
         "o": merged["layers"]["attn"]["o"] - base["layers"]["attn"]["o"],
         "up": merged["layers"]["mlp"]["up"] - base["layers"]["mlp"]["up"]}
  for k in want:
    np.testing.assert_allclose(got[k], 2 * want[k], rtol=1e-4, atol=1e-6)
  assert np.array_equal(merged["layers"]["attn"]["k"], base["layers"]["attn"]["k"])
  # bfloat16 weights stay bfloat16 (the sum in float32)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
  assert lora.merge(bf16, adapters, 8.0, 4)["layers"]["attn"]["q"].dtype == jnp.bfloat16


def test_an_int8_base_keeps_each_output_channels_absmax_scale_and_the_logical_names():
  """QLoRA-style base: the layer weights as int8 with a float32 scale per output channel (batch
  axes kept), within half a step of the weight; the scale drops the input axes' names; embedding,
  output projection and norms untouched; float_like + requantize rebuild it exactly."""
  boxed = boxed_params(n_experts=4, top_k=2, d_ff_expert=16)
  abstract = jax.eval_shape(lora.quantize, boxed)
  q = abstract["layers"]["attn"]["q"]  # [Z, D, H, K]: D reduced
  assert (q.q.value.shape, q.q.names, q.q.value.dtype) == (
      (2, 32, 4, 8), ("layers", "embed", "heads", "head_dim"), jnp.int8)
  assert (q.scale.value.shape, q.scale.names) == ((2, 1, 4, 8), ("layers", None, "heads", "head_dim"))
  down = abstract["layers"]["moe"]["down"]  # [Z, E, F, D]: F reduced, experts kept
  assert down.scale.value.shape == (2, 4, 1, 32) and down.axes == (2,)
  params = jax.tree.map(np.asarray, nn.unbox(jax.jit(Transformer(ModelConfig(
      vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
      max_seq_len=32)).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]))
  quantized = lora.quantize(params)
  back = lora.dequantize(quantized)
  for name in ("layers/attn/q", "layers/attn/o", "layers/mlp/down"):
    w, node = at(params, name), at(quantized, name)
    assert node.q.dtype == jnp.int8 and node.dtype == "float32"
    err = np.abs(np.asarray(at(back, name)) - w)
    assert np.all(err <= np.asarray(node.scale) / 2 + 1e-7), name
    assert np.abs(np.asarray(node.q)).max() == 127  # each channel's absmax maps to 127
  for name in ("embed", "final_norm/scale"):
    assert at(quantized, name) is at(params, name)
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: cpu, quantized)
  like = lora.float_like(quantized, shardings)
  assert at(like, "layers/attn/q").dtype == jnp.float32 and at(like, "layers/attn/q").shape == (
      2, 32, 4, 8)
  again = lora.requantize(quantized, params, shardings)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(quantized),
                                                  jax.tree.leaves(again)))
