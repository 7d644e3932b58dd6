"""Grouped-query attention (Ainslie et al., 2023) with rotary positions, document masking and a
KV cache for autoregressive decoding. MHA is n_kv_heads == n_heads, MQA is n_kv_heads == 1.

Attention takes segment ids and token indices, never a [B, L, S] mask: `attend` picks the
implementation (`model.attention`) and each builds what it needs; all compute
`kernels/attention/reference.attention`."""

import functools
import logging
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain import collectives
from jaxtrain.collectives import constrain
from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.kernels import manual, platform
from jaxtrain.kernels.attention import blockwise, reference
from jaxtrain.model import axes, context, dense, pipeline
from jaxtrain.model.layers import param, rope

NEG_INF = -1e30
# auto on CPU: xla (materialized scores) below this many keys, blockwise from it; the measured
# crossover lies between 1K and 4K tokens (benchmarks/RESULTS.md, "Attention implementations")
CPU_BLOCKWISE_FROM = 2048
QUERY_BLOCKS = 4  # xla_causal: the queries in this many blocks (10/16 of the scores computed)


def dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask_BLS):
  """Softmax attention in float32; each kv head serves n_heads / n_kv_heads query heads."""
  r = q_BLHK.shape[2] // k_BSGK.shape[2]
  k_BSHK, v_BSHK = jnp.repeat(k_BSGK, r, axis=2), jnp.repeat(v_BSGK, r, axis=2)
  scale = 1.0 / jnp.sqrt(q_BLHK.shape[-1]).astype(jnp.float32)
  scores_BHLS = jnp.einsum("BLHK,BSHK->BHLS", q_BLHK, k_BSHK,
                           preferred_element_type=jnp.float32) * scale
  scores_BHLS = jnp.where(mask_BLS[:, None], scores_BHLS, NEG_INF)
  probs_BHLS = jax.nn.softmax(scores_BHLS, axis=-1).astype(v_BSHK.dtype)
  return jnp.einsum("BHLS,BSHK->BLHK", probs_BHLS, v_BSHK)


def xla_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, cfg):
  """The [B, H, L, S] scores materialized; a query that may attend no key averages all values
  (unlike the reference's zeros), which only padding queries do."""
  mask_BLS = reference.mask(q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)
  return dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask_BLS)


def xla_causal_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                         k_index_BS, cfg):
  """xla_attention with the queries in QUERY_BLOCKS blocks, block i against the keys of blocks
  0..i only: the scores above the diagonal, masked anyway, are never computed. Exact (the skipped
  keys' weights are exact zeros) where indices are arange, which `choose` picks it for, but for a
  query that attends no key (padding), which averages its block's keys' values; queries that are
  not the keys (L != S: context parallelism's shards) and lengths QUERY_BLOCKS does not divide run
  xla_attention.
  On CPU about 1.04x small_20m's step on an Intel host, 1.01-1.10x on an AMD one
  (benchmarks/RESULTS.md, "jaxtrain vs PyTorch on CPU")."""
  l, s = q_BLHK.shape[1], k_BSGK.shape[1]
  if l != s or l % QUERY_BLOCKS:
    return xla_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                         cfg)
  mask_BLS = reference.mask(q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)
  c = l // QUERY_BLOCKS
  return jnp.concatenate([
      dot_product_attention(q_BLHK[:, i * c:(i + 1) * c], k_BSGK[:, :(i + 1) * c],
                            v_BSGK[:, :(i + 1) * c], mask_BLS[:, i * c:(i + 1) * c, :(i + 1) * c])
      for i in range(QUERY_BLOCKS)], axis=1)


def blockwise_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                        cfg):
  """Online softmax over `cfg.attention_block` keys at a time, memory linear in length
  (also decodes)."""
  return blockwise.attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                             k_index_BS, block=cfg.attention_block)


def cudnn_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                    cfg):
  """cuDNN flash attention: causal over in-order indices, one document per row
  (`choose` guarantees both)."""
  return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, is_causal=True,
                                      implementation="cudnn")


def pallas_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                     cfg):
  """The Pallas flash-attention kernel (jaxtrain/kernels/flash_attention),
  by segment ids and indices."""
  from jaxtrain.kernels.flash_attention import ops
  return ops.flash_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                             k_index_BS)


def splash_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS,
                     cfg):
  """TPU splash attention: causal over in-order indices (its mask is static),
  documents by segment ids."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  b, l, h, kd = q_BLHK.shape
  g, s = k_BSGK.shape[2], k_BSGK.shape[1]
  kernel = splash.make_splash_mqa_single_device(
      splash.MultiHeadMask([splash.CausalMask((l, s))] * (h // g)))
  q_BGRLK = (jnp.einsum("BLGRK->BGRLK", q_BLHK.reshape(b, l, g, h // g, kd))
             / jnp.sqrt(kd).astype(q_BLHK.dtype))
  k_BGSK, v_BGSK = jnp.einsum("BSGK->BGSK", k_BSGK), jnp.einsum("BSGK->BGSK", v_BSGK)
  per_group = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over kv heads, then over the batch
  out_BGRLK = jax.vmap(per_group)(q_BGRLK, k_BGSK, v_BGSK,
                                  splash.SegmentIds(q_segment_BL, k_segment_BS))
  return jnp.einsum("BGRLK->BLGRK", out_BGRLK).reshape(b, l, h, kd)


IMPLEMENTATIONS = {
    "xla": xla_attention,
    "xla_causal": xla_causal_attention,
    "blockwise": blockwise_attention,
    "cudnn": cudnn_attention,
    "pallas": pallas_attention,
    "splash": splash_attention,
}
# The backends an implementation compiles for (tests/targets/test_kernels.py); the others run
# anywhere. The Pallas flash kernel is Triton's (interpreted on CPU): its blocks do not tile as
# Mosaic needs.
BACKENDS = {"cudnn": ("gpu",), "splash": ("tpu",), "pallas": ("gpu", "cpu")}
# causal by position in the row: cannot honour permuted indices
IN_ORDER_ONLY = ("cudnn", "splash", "xla_causal")
KERNELS = ("pallas", "splash")  # custom calls: compiled, they run per shard (`per_shard`)


@functools.cache
def _log_once(message):
  logging.getLogger(__name__).warning(message)


def choose(cfg, length, packed, in_order, decode=False, backend=None, causal=True):
  """The implementation `attend` runs: `cfg.attention` resolved for this backend, key length and
  batch.

  `packed`: segment ids may hold several documents or padding per row; `in_order`: indices are
  arange. cudnn honours neither packed documents nor permuted indices (jax's cudnn call masks by
  per-row lengths only) and takes no float32: `auto` on a GPU sends those batches to the Pallas
  flash kernel, checked against the reference on an H200 (float32 and bfloat16, packed and
  permuted rows, forward and backward, gpt2_small's and llama_1b's shapes) and 1.44-1.52x faster
  than xla in their train steps (benchmarks/RESULTS.md, 2026-12-04); cudnn asked for explicitly
  falls back to xla, said once in the log. splash honours no permuted indices: xla (blockwise from
  CPU_BLOCKWISE_FROM keys). Decoding (queries against the whole KV cache, a few queries at a time,
  memory-bound) runs xla unless blockwise was asked for: the kernels expect L == S. Not `causal`
  (the encoder, which config refuses anything but auto, xla and blockwise): xla, blockwise from
  CPU_BLOCKWISE_FROM keys, on every backend (no kernel is checked bidirectional yet). `auto` on
  CPU: xla_causal for in-order indices (xla for permuted ones), blockwise from
  CPU_BLOCKWISE_FROM keys."""
  backend = backend or platform.backend()
  name = cfg.attention
  if not causal:
    return name if name != "auto" else "xla" if length < CPU_BLOCKWISE_FROM else "blockwise"
  if name in BACKENDS and backend not in BACKENDS[name]:
    raise ConfigError(
        f"model.attention={name!r} needs a {' or '.join(b.upper() for b in BACKENDS[name])}, "
        f"this is {backend!r}; use auto, xla or blockwise")
  half = jnp.dtype(cfg.compute_dtype).itemsize == 2  # cuDNN's fused attention takes no float32
  if name == "cudnn" and not half:
    raise ConfigError(f"model.attention='cudnn' needs compute_dtype bfloat16 or float16, got "
                      f"{cfg.compute_dtype!r}; use auto, xla or blockwise")
  if name == "auto":
    cpu = ("xla_causal" if in_order else "xla") if length < CPU_BLOCKWISE_FROM else "blockwise"
    gpu = "cudnn" if half and not packed and in_order else "pallas"
    name = {"tpu": "splash", "gpu": gpu}.get(backend, cpu)
  if decode and name != "blockwise":
    return "xla"
  if name == "cudnn" and packed:
    _log_once("attention: cudnn cannot mask packed documents (segment ids), "
              "using xla for packed batches")
    return "xla"
  if name == "splash" and pipeline.inside_stage():
    # jax's splash kernel does not say how its cotangents vary, which autodiff refuses inside the
    # pipeline's shard_map (model.attention=splash with stages is refused by the config)
    fallback = "blockwise" if length >= CPU_BLOCKWISE_FROM else "xla"
    _log_once(f"attention: splash cannot run inside a pipeline stage, using {fallback}")
    return fallback
  if name in IN_ORDER_ONLY and not in_order:
    # memory linear in length where the [B, H, L, S] scores would not fit (context parallelism's
    # load-balanced order at 16K+ on TPU: long_32k's xla step needs 24.67 GiB a v5e chip)
    fallback = "blockwise" if length >= CPU_BLOCKWISE_FROM else "xla"
    _log_once(f"attention: {name} is causal by position only, "
              f"using {fallback} for permuted token indices")
    return fallback
  return name


def per_shard(implementation, check_vma: bool = True):
  """`implementation` on each device's rows and heads (kernels/manual.per_shard): GSPMD would
  gather a custom call's operands whole, and Mosaic refuses to be partitioned by it. Heads stay
  whole where the mesh axes they lie on do not divide both head counts (GQA maps query head h to
  kv head h // R, shard by shard only if both split alike)."""

  def run(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS):
    q_spec = collectives.logical_spec((axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM))
    kv_spec = collectives.logical_spec((axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM))
    ids_spec = collectives.logical_spec((axes.BATCH, axes.SEQ))
    ways = math.prod(collectives.axis_size(a) for a in manual.spec_axes(P(q_spec[2])))
    if q_spec[2] != kv_spec[2] or q_BLHK.shape[2] % ways or k_BSGK.shape[2] % ways:
      q_spec, kv_spec = P(*q_spec[:2], None, None), P(*kv_spec[:2], None, None)
    run_shard = manual.per_shard(implementation, (q_spec, kv_spec, kv_spec) + (ids_spec,) * 4,
                                 q_spec, check_vma)
    return run_shard(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)

  return run


def attend(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS, cfg,
           decode=False, causal=True):
  """Softmax attention of q [B, L, H, K] over k, v [B, S, G, K] by segment ids and token indices.

  Segment ids None: one document per row, no padding; indices None: arange (0..L-1 / 0..S-1).
  Implementation by `choose`; every one equals `kernels/attention/reference.attention` on queries
  that attend a key. Not `causal` (a bidirectional encoder): every key of the query's document,
  given to the implementations as indices that put every key before every query."""
  (b, l), s = q_BLHK.shape[:2], k_BSGK.shape[1]
  name = choose(cfg, s, packed=q_segment_BL is not None, in_order=q_index_BL is None, decode=decode,
                causal=causal)
  if q_segment_BL is None:
    q_segment_BL, k_segment_BS = jnp.ones((b, l), jnp.int32), jnp.ones((b, s), jnp.int32)
  if not causal:
    q_index_BL, k_index_BS = jnp.full((b, l), s, jnp.int32), jnp.zeros((b, s), jnp.int32)
  if q_index_BL is None:
    q_index_BL = jnp.broadcast_to(jnp.arange(l), (b, l))
    k_index_BS = jnp.broadcast_to(jnp.arange(s), (b, s))
  implementation = functools.partial(IMPLEMENTATIONS[name], cfg=cfg)
  # the sequence is sharded: each shard's queries against all keys, inside context's shard_map,
  # manual over every axis these arrays lie on (a kernel there sees its shard already)
  if not decode and context.shards() > 1:
    return context.context_attention(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL,
                                     k_index_BS, implementation)
  if name in KERNELS and platform.backend() != "cpu":  # CPU: interpreted, under GSPMD as it is
    implementation = per_shard(implementation, check_vma=name != "splash")
  return implementation(q_BLHK, k_BSGK, v_BSGK, q_segment_BL, k_segment_BS, q_index_BL, k_index_BS)


def branched_attention(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, index_BL, branch_ids_BL):
  """Self-attention over documents that branch after a shared prefix (eval/score.py scores all
  the continuations of one context in one document): the causal document mask, less any key of a
  branch b > 0 for queries outside b; the prefix (branch 0) is seen by the whole document. The
  [B, H, L, L] scores materialized (xla_attention's way, with its extra term), under GSPMD; no
  kernel or context-parallel form."""
  if segment_ids_BL is None:
    raise ConfigError("branch ids need segment ids: the document each branch belongs to")
  if context.shards() > 1:
    raise ConfigError("branch ids cannot run with the sequence sharded (mesh.context > 1)")
  if index_BL is None:
    index_BL = jnp.broadcast_to(jnp.arange(segment_ids_BL.shape[1]), segment_ids_BL.shape)
  k_branch_B1S = branch_ids_BL[:, None, :]
  same_branch_BLS = (k_branch_B1S == 0) | (k_branch_B1S == branch_ids_BL[:, :, None])
  mask_BLS = reference.mask(segment_ids_BL, segment_ids_BL, index_BL, index_BL) & same_branch_BLS
  return dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask_BLS)


class Attention(nn.Module):
  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, index_BL, branch_ids_BL=None):
    c = self.cfg
    pd, cd = c.param_dtype, c.compute_dtype
    std, out_std = c.init_std, c.init_std / (2 * c.n_layers) ** 0.5
    w_q = param(self, "q", (c.d_model, c.n_heads, c.head_dim),
                (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pd, std)
    w_k = param(self, "k", (c.d_model, c.n_kv_heads, c.head_dim),
                (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd, std)
    w_v = param(self, "v", (c.d_model, c.n_kv_heads, c.head_dim),
                (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd, std)
    w_o = param(self, "o", (c.n_heads, c.head_dim, c.d_model),
                (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pd, out_std)

    x_BLD = x_BLD.astype(cd)
    q_BLHK = dense.einsum("BLD,DHK->BLHK", x_BLD, w_q.astype(cd), c)
    k_BLGK = dense.einsum("BLD,DGK->BLGK", x_BLD, w_k.astype(cd), c)
    v_BLGK = dense.einsum("BLD,DGK->BLGK", x_BLD, w_v.astype(cd), c)
    q_BLHK = constrain(rope(q_BLHK, positions_BL, c),
                       (axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM))
    k_BLGK = constrain(rope(k_BLGK, positions_BL, c),
                       (axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM))
    v_BLGK = constrain(v_BLGK, (axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM))

    if self.decode:
      if segment_ids_BL is None:
        segment_ids_BL = jnp.ones(x_BLD.shape[:2], jnp.int32)
      k_BSGK, v_BSGK, k_segment_BS, q_index_BL, k_index_BS = self._update_cache(
          k_BLGK, v_BLGK, segment_ids_BL)
      out_BLHK = attend(q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, k_segment_BS, q_index_BL,
                        k_index_BS, c, decode=True)
    elif branch_ids_BL is not None:
      out_BLHK = branched_attention(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, index_BL,
                                    branch_ids_BL)
    else:
      out_BLHK = attend(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, segment_ids_BL, index_BL, index_BL,
                        c)
    out_BLHK = constrain(out_BLHK, (axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM))
    return dense.einsum("BLHK,HKD->BLD", out_BLHK, w_o.astype(cd), c)

  def _update_cache(self, k_BLGK, v_BLGK, segment_ids_BL):
    """Writes the new keys/values and segment ids at the cache index; returns the cache (keys,
    values, segment ids) and the query and key indices.

    Decoding holds one document per row, whose slots count from the cache index: the indices mask
    future slots, segment id 0 masks unwritten slots and padding (a left-padded prompt's leading pad
    tokens)."""
    b, l, g, kd = k_BLGK.shape
    s = self.cfg.max_seq_len
    cached_k = self.variable("cache", "k", jnp.zeros, (b, s, g, kd), k_BLGK.dtype)
    cached_v = self.variable("cache", "v", jnp.zeros, (b, s, g, kd), v_BLGK.dtype)
    cached_segment = self.variable("cache", "segment", jnp.zeros, (b, s), jnp.int32)
    index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    i = index.value
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k_BLGK, (0, i, 0, 0))
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v_BLGK, (0, i, 0, 0))
    cached_segment.value = jax.lax.dynamic_update_slice(cached_segment.value,
                                                        segment_ids_BL.astype(jnp.int32), (0, i))
    index.value = i + l
    q_index_BL = jnp.broadcast_to(i + jnp.arange(l), (b, l))
    k_index_BS = jnp.broadcast_to(jnp.arange(s), (b, s))
    return cached_k.value, cached_v.value, cached_segment.value, q_index_BL, k_index_BS
