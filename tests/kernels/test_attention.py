"""Every attention implementation equals `kernels/attention/reference.attention`, forward and backward, over
packed documents with padding, permuted indices, GQA/MQA, lengths not a multiple of the block, f32 and bf16;
blockwise's compiled memory grows linearly with length where materialized scores grow quadratically."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.kernels.attention import blockwise, reference
from jaxtrain.model import attention

# Tolerances by dtype: f32 differs from the reference only by summation order; bf16 inputs are rounded
# by both, but blockwise rounds probabilities and score gradients to bf16 before its matmuls (as flash
# kernels do) where the reference stays in f32: a few bf16 ulps of values of order 1.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def inputs(b, l, s, h, g, kd, dtype, seed=0, permute=False):
  """Random q, k, v; rows packed with documents of random lengths and right padding (segment 0)."""
  rng = np.random.default_rng(seed)
  q_BLHK, k_BSGK, v_BSGK = (jnp.asarray(rng.normal(size=shape), dtype)
                            for shape in ((b, l, h, kd), (b, s, g, kd), (b, s, g, kd)))
  segment_BS = np.zeros((b, s), np.int32)
  for row in segment_BS:
    ends = np.sort(rng.choice(np.arange(1, s), size=2, replace=False))  # two documents, then padding
    row[:ends[0]], row[ends[0]:ends[1]] = 1, 2
  index_BS = np.broadcast_to(np.arange(s), (b, s)).copy()
  if permute:  # context parallelism's view: tokens in another order, causality by their indices
    order = rng.permutation(s)
    segment_BS, index_BS = segment_BS[:, order], index_BS[:, order]
  # queries: the last l tokens of the row (l < s: a chunk of queries against a longer context)
  return (q_BLHK, k_BSGK, v_BSGK, jnp.asarray(segment_BS[:, s - l:]), jnp.asarray(segment_BS),
          jnp.asarray(index_BS[:, s - l:]), jnp.asarray(index_BS))


def loss_and_grads(fn, args):
  """A weighted sum of the output over queries that attend some key, and its gradients in q, k, v."""
  valid_BL = reference.mask(*args[3:]).any(-1)
  weights = jnp.cos(jnp.arange(args[0].shape[-1]))

  def loss(q, k, v):
    out_BLHK = fn(q, k, v, *args[3:]).astype(jnp.float32)
    return jnp.sum(jnp.where(valid_BL[:, :, None, None], out_BLHK * weights, 0.0))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args[:3])


def assert_close(got, want, dtype):
  got, want = jax.tree.map(lambda x: np.asarray(x, np.float32), (got, want))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=TOLERANCE[dtype] * max(1.0, np.abs(w).max()), rtol=0)


CASES = [  # b, l, s, h, g, k, block, permute
    (2, 37, 37, 4, 2, 8, 16, False),  # GQA, length not a multiple of the block
    (1, 64, 64, 4, 1, 16, 16, True),  # MQA, permuted indices
    (2, 20, 52, 6, 6, 8, 32, False),  # MHA, queries a chunk of a longer context, S not a multiple
    (1, 9, 9, 2, 1, 4, 512, False),  # one block bigger than the sequence
]


@pytest.mark.parametrize("b, l, s, h, g, kd, block, permute, dtype", [
    *(case + (jnp.float32,) for case in CASES[:2]), CASES[0] + (jnp.bfloat16,),  # the rest: slow (compile time)
    *(pytest.param(*case, jnp.float32, marks=pytest.mark.slow) for case in CASES[2:]),
    *(pytest.param(*case, jnp.bfloat16, marks=pytest.mark.slow) for case in CASES[1:])])
def test_blockwise_equals_reference(b, l, s, h, g, kd, block, permute, dtype):
  args = inputs(b, l, s, h, g, kd, dtype, permute=permute)
  want = loss_and_grads(reference.attention, args)
  got = loss_and_grads(lambda *a: blockwise.attention(*a, block=block), args)
  assert_close(got, want, dtype)
  out = blockwise.attention(*args, block=block)
  assert out.dtype == dtype
  assert_close(out, reference.attention(*args), dtype)  # zeros included, for queries that attend nothing


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_equals_reference_on_attending_queries(dtype):
  args = inputs(2, 37, 37, 4, 2, 8, dtype, permute=True)
  cfg = ModelConfig(attention="xla")
  want = loss_and_grads(reference.attention, args)
  got = loss_and_grads(lambda *a: attention.xla_attention(*a, cfg), args)
  assert_close(got, want, dtype)


@pytest.mark.parametrize("b, l, s, dtype", [
    (2, 64, 64, jnp.float32),  # 4 query blocks of 16
    (1, 64, 64, jnp.bfloat16),
    (2, 37, 37, jnp.float32),  # 4 does not divide 37: one block, xla's program
    (2, 20, 52, jnp.float32),  # queries a chunk of a longer context: one block
])
def test_xla_causal_equals_reference_and_xla_on_keys_in_order(b, l, s, dtype):
  """Query blocks against the keys up to their diagonal: the reference's values and gradients, and
  xla's to rounding (the keys it skips weigh exact zeros there)."""
  args = inputs(b, l, s, 4, 2, 8, dtype, permute=False)
  cfg = ModelConfig(attention="xla_causal")
  got = loss_and_grads(lambda *a: attention.xla_causal_attention(*a, cfg), args)
  assert_close(got, loss_and_grads(reference.attention, args), dtype)
  assert_close(got, loss_and_grads(lambda *a: attention.xla_attention(*a, cfg), args), dtype)


def test_pallas_equals_reference():
  ops = pytest.importorskip("jaxtrain.kernels.flash_attention.ops")
  del ops
  args = inputs(2, 128, 128, 4, 2, 16, jnp.float32, permute=True)
  cfg = ModelConfig(attention="pallas")
  assert_close(loss_and_grads(lambda *a: attention.pallas_attention(*a, cfg), args),
               loss_and_grads(reference.attention, args), jnp.float32)


def test_choose_float32_on_gpu_takes_no_cudnn():
  """cuDNN's fused attention takes bf16/fp16 only: a float32 model on a GPU (long_16k, moe_tiny
  compiled for H100 failed there: "Q must be fp16/bf16/fp8") takes the Pallas flash kernel (checked
  in float32 on an H200), and asking for cudnn is a one-line error."""
  cfg = ModelConfig(attention="auto", compute_dtype="float32")
  assert attention.choose(cfg, 1024, packed=False, in_order=True, backend="gpu") == "pallas"
  assert attention.choose(cfg, 16384, packed=False, in_order=True, backend="gpu") == "pallas"
  with pytest.raises(ConfigError, match="compute_dtype"):
    attention.choose(ModelConfig(attention="cudnn", compute_dtype="float32"), 1024, False, True,
                     backend="gpu")


@pytest.mark.parametrize("name, backend, length, packed, in_order, decode, want", [
    ("auto", "cpu", 128, True, True, False, "xla_causal"),
    ("auto", "cpu", 128, True, False, False, "xla"),  # query blocks need keys in order
    ("xla_causal", "cpu", 128, True, False, False, "xla"),
    ("auto", "cpu", 128, True, True, True, "xla"),  # decoding
    ("auto", "cpu", attention.CPU_BLOCKWISE_FROM, True, True, False, "blockwise"),
    ("auto", "gpu", 4096, False, True, False, "cudnn"),
    # cudnn cannot mask packed documents, nor permuted indices: the Pallas flash kernel, checked
    # on an H200 for both (2026-12-04)
    ("auto", "gpu", 4096, True, True, False, "pallas"),
    ("auto", "gpu", 1024, False, False, False, "pallas"),
    ("auto", "gpu", 4096, True, False, False, "pallas"),
    ("auto", "tpu", 4096, True, True, False, "splash"),
    ("auto", "tpu", 1024, True, False, False, "xla"),  # splash's causal mask is by position
    ("auto", "tpu", 4096, True, False, False, "blockwise"),
    ("cudnn", "gpu", 4096, True, True, False, "xla"),
    ("pallas", "gpu", 4096, True, False, False, "pallas"),  # asked for: packed and permuted
    ("pallas", "cpu", 128, True, True, False, "pallas"),  # interpreted
    ("auto", "gpu", 4096, False, True, True, "xla"),  # decoding: queries against the cache
    ("blockwise", "cpu", 4096, True, True, True, "blockwise"),
    ("xla", "gpu", 4096, True, True, False, "xla"),
])
def test_choose(name, backend, length, packed, in_order, decode, want):
  cfg = ModelConfig(attention=name, compute_dtype="bfloat16")
  assert attention.choose(cfg, length, packed, in_order, decode, backend) == want


@pytest.mark.parametrize("name, backend", [
    ("splash", "cpu"), ("splash", "gpu"), ("cudnn", "cpu"), ("cudnn", "tpu"),
    ("pallas", "tpu"),  # Triton's kernel: Mosaic cannot tile its blocks
])
def test_choose_refuses_other_backends(name, backend):
  with pytest.raises(ConfigError, match=f"model.attention='{name}' needs a"):
    attention.choose(ModelConfig(attention=name), 128, True, True, False, backend)


def test_fallback_said_once_in_the_log(caplog):
  attention._log_once.cache_clear()
  cfg = ModelConfig(attention="cudnn", compute_dtype="bfloat16")
  with caplog.at_level("WARNING", logger=attention.__name__):
    for _ in range(3):
      attention.choose(cfg, 4096, True, True, False, "gpu")
  assert len(caplog.records) == 1 and "packed documents" in caplog.records[0].getMessage()
  assert "\n" not in caplog.records[0].getMessage()


def temp_bytes(fn, b, l, h, kd):
  """Compiled temporary memory of forward + backward (summed output's gradients in q, k, v) at length l."""
  args = inputs(b, l, l, h, h, kd, jnp.float32)

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v, *args[3:]))
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[:3]]
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.optimized
@pytest.mark.slow  # compiles 7 programs up to 16K tokens (~1 min here)
def test_blockwise_memory_grows_linearly_xla_quadratically():
  lengths = [2048, 4096, 8192, 16384]
  cfg = ModelConfig(attention="xla")
  block = [temp_bytes(lambda *a: blockwise.attention(*a, block=512), 1, l, 2, 32) for l in lengths]
  for l, m in zip(lengths[1:], block[1:]):  # within 10% of linear
    assert m <= 1.1 * block[0] * l / lengths[0], (lengths, block)
  xla = [temp_bytes(lambda *a: attention.xla_attention(*a, cfg), 1, l, 2, 32) for l in lengths[:3]]
  assert xla[2] >= 0.9 * 16 * xla[0], (lengths, xla)  # 4x the length: ~16x the memory
