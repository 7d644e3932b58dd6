"""Every Pallas kernel compiled, not only lowered, by the compiler of each target it claims, at the
shapes of the shipped configs (configs/gpt2_small.py, llama_1b.py, llama_8b.py; one row): TPU
(Mosaic, `tpu_custom_call`) for rms_norm, quantize and jax's splash attention; GPU (Triton,
`__gpu$xla.gpu.triton`) for rms_norm, quantize, flash attention and cross-entropy. Forward and
backward. On a multi-device target each kernel runs per shard (kernels/manual.per_shard): its
operands are the shard's, and no all-gather of activations surrounds it (a replicated layout, the
control, shows one). Compiled is not executed: these say nothing of the numbers.

Skipped with the reason when libtpu / the CUDA plugin is missing (`make test-targets`)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jaxtrain
from jaxtrain import builder, collectives, parallel
from jaxtrain.config import ModelConfig
from jaxtrain.kernels import platform
from jaxtrain.kernels.cross_entropy import ops as ce_ops
from jaxtrain.kernels.flash_attention import ops as flash_ops
from jaxtrain.kernels.quantize import ops as quantize_ops
from jaxtrain.kernels.rms_norm import ops as rms_norm_ops
from jaxtrain.model import attention, axes
from jaxtrain.parallel import hlo_bytes

TPU, GPU = "tpu-v5e:2x2", "h100:4"
CALLS = {"tpu": 'custom_call_target="tpu_custom_call"',
         "gpu": 'custom_call_target="__gpu$xla.gpu.triton"'}
CONFIGS = ["gpt2_small", "llama_1b", pytest.param("llama_8b", marks=pytest.mark.slow)]
# each kernel's pallas_calls, forward and backward
RMS_NORM = ["add_rms_norm_forward", "add_rms_norm_backward"]
SPLASH = ["splash_mqa_fwd", "splash_mqa_dq", "splash_mqa_dkv"]
FLASH = ["flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv"]
CROSS_ENTROPY = ["cross_entropy_forward", "cross_entropy_dx", "cross_entropy_dw"]


def _model(name: str):
  """The config's model section and sequence length."""
  cfg = jaxtrain.get_config(f"configs/{name}.py")
  return cfg.model, cfg.train.seq_len


def _mesh(devices, rules="fsdp", **sizes):
  shape = [sizes.get(a, 1) for a in parallel.MESH_AXES]
  return Mesh(np.asarray(devices[:math.prod(shape)]).reshape(shape), parallel.MESH_AXES,
              axis_types=(AxisType.Auto,) * len(shape)), rules


def _compile(devices, fn, args, mesh_rules=None):
  """Compiled HLO text of jit(fn) for `args` ((shape, dtype, spec) on the mesh; default: one
  device), traced for the devices' platform."""
  mesh, rules = mesh_rules or _mesh(devices)
  structs = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec)) for s, d, spec in args]
  with parallel.activate(mesh, rules), platform.target(devices[0].platform):
    lowered = jax.jit(fn).lower(*structs)
  return lowered.compile().as_text()


def _kernels(text: str, kind: str, names) -> dict[str, str]:
  """Each of `names` -> the one compiled custom call of `kind` that names it (the pallas_call's
  name, in its instruction name or its op_name); every custom call of that kind is one of them."""
  calls = [line for line in text.splitlines() if CALLS[kind] in line]
  found = {n: [line for line in calls if re.search(rf"\b\w*{n}\w*\b", line)] for n in names}
  assert all(len(lines) == 1 for lines in found.values()), {n: len(v) for n, v in found.items()}
  assert len(calls) == len(names), [line[:80] for line in calls]
  return {n: lines[0] for n, lines in found.items()}


def _operands(line: str) -> list[tuple[int, ...]]:
  """The operand shapes of a custom-call line."""
  layouts = re.search(r"operand_layout_constraints=\{(.*?\})\}", line).group(1)
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"\w+\[([\d,]*)\]", layouts)]


def _gathers(text: str, mesh, shard_bytes: float) -> list:
  """All-gathers whose result is at least one device's share of an activation."""
  return [c for c in hlo_bytes.collectives(text, mesh)
          if c.kind == "all-gather" and c.result_bytes >= shard_bytes]


def _rms_norm(tokens):
  """Gradients of a loss through add_rms_norm; `tokens()` lays out the rows (called as it traces,
  under the mesh)."""

  def loss(x, residual, scale):
    normed, h = rms_norm_ops.add_rms_norm(x, residual, scale, 1e-5, impl="pallas", tokens=tokens())
    return jnp.sum(normed.astype(jnp.float32) ** 2) + jnp.sum(h.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def _attention(cfg):
  """Gradients of a loss through `attend` (segment ids None: one document a row)."""

  def loss(q, k, v, segment_ids=None):
    out = attention.attend(q, k, v, segment_ids, segment_ids, None, None, cfg)
    return jnp.sum(out.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def _tokens():
  return collectives.logical_spec((axes.BATCH, axes.SEQ))


# ---- TPU (Mosaic) --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_rms_norm_compiles_for_tpu(target_devices, name):
  devices = target_devices(TPU)
  m, l = _model(name)
  x = ((1, l, m.d_model), jnp.bfloat16, P())
  text = _compile(devices, _rms_norm(_tokens), [x, x, ((m.d_model,), jnp.float32, P())])
  _kernels(text, "tpu", RMS_NORM)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "fp8", "int8", "int4"])
def test_quantize_compiles_for_tpu(target_devices, fmt):
  """The comm kernel on a piece of a flat gradient (comm.block 256); int4 packs its bytes by a
  matmul on TPU (Mosaic cannot lower strided loads)."""
  devices = target_devices(TPU)
  scale = jnp.float32(1.0) if fmt == "fp8" else None
  fn = lambda g, e: quantize_ops.quantize_with_feedback(g, e, fmt, 256, scale, impl="pallas")
  g = ((2, 1 << 16), jnp.float32, P())
  _kernels(_compile(devices, fn, [g, g]), "tpu", [f"quantize_{fmt}_with_feedback"])


@pytest.mark.parametrize("name", CONFIGS)
def test_splash_is_auto_and_compiles_for_tpu(target_devices, name):
  """model.attention=auto on TPU is jax's splash kernel, forward, dq and dk/dv, packed rows too."""
  devices = target_devices(TPU)
  m, l = _model(name)
  assert attention.choose(ModelConfig(attention="auto"), l, True, True, backend="tpu") == "splash"
  q = ((1, l, m.n_heads, m.head_dim), jnp.bfloat16, P())
  kv = ((1, l, m.n_kv_heads, m.head_dim), jnp.bfloat16, P())
  text = _compile(devices, _attention(ModelConfig(attention="auto")),
                  [q, kv, kv, ((1, l), jnp.int32, P())])
  _kernels(text, "tpu", SPLASH)


def test_rms_norm_runs_per_shard_on_tpu(target_devices):
  """gpt2_small's width, 4 rows over data x fsdp: each device's kernel normalizes its own row; the
  only all-gather is the scale's (fsdp shards it), the only all-reduce dscale's."""
  devices = target_devices(TPU)
  b, l, d = 4, 1024, 768
  mesh_rules = _mesh(devices, data=2, fsdp=2)
  x = ((b, l, d), jnp.bfloat16, P(("data", "fsdp")))
  args = [x, x, ((d,), jnp.float32, P("fsdp"))]
  text = _compile(devices, _rms_norm(_tokens), args, mesh_rules)
  for line in _kernels(text, "tpu", RMS_NORM).values():
    assert _operands(line)[0] == (l, d)  # one row of four
  assert not _gathers(text, mesh_rules[0], b * l * d * 2 / 4)
  # the control: the same kernels on replicated rows gather the activations first
  text = _compile(devices, _rms_norm(lambda: None), args, mesh_rules)
  assert _gathers(text, mesh_rules[0], b * l * d * 2 / 4)


def test_splash_runs_per_shard_on_tpu(target_devices):
  """llama_1b's heads (32 over 8 kv heads), 2 rows over data, heads over tensor (fsdp_tp): each
  device attends its row with its 16 heads and 4 kv heads; no collective at all."""
  devices = target_devices(TPU)
  m, l = _model("llama_1b")
  mesh_rules = _mesh(devices, "fsdp_tp", data=2, tensor=2)
  q = ((2, l, m.n_heads, m.head_dim), jnp.bfloat16, P("data", None, "tensor"))
  kv = ((2, l, m.n_kv_heads, m.head_dim), jnp.bfloat16, P("data", None, "tensor"))
  text = _compile(devices, _attention(ModelConfig(attention="splash")),
                  [q, kv, kv, ((2, l), jnp.int32, P("data"))], mesh_rules)
  forward = _operands(_kernels(text, "tpu", SPLASH)["splash_mqa_fwd"])
  # q as [kv heads, query heads per kv head, L, K] of one row (splash is vmapped over rows)
  assert (m.n_kv_heads // 2, m.n_heads // m.n_kv_heads, l, m.head_dim) in forward, forward
  assert not hlo_bytes.collectives(text, mesh_rules[0])


def test_quantize_runs_per_device_on_tpu(target_devices):
  """As compressed reduction runs it: inside a shard_map over data only (optim/compress.py), on a
  mesh whose other axes stay automatic; Mosaic refuses that unless the kernel opens its own
  shard_map over them. Each device quantizes its own piece; nothing is communicated."""
  devices = target_devices(TPU)
  mesh_rules = _mesh(devices, data=2, fsdp=2)

  def reduce_like(g, e):
    def local(g, e):
      payload, _, error = quantize_ops.quantize_with_feedback(g[0], e[0], "int8", 256,
                                                              impl="pallas")
      return payload[None], error[None]
    specs = (P("data"), P("data"))
    return collectives.shard_map(local, ("data",), specs, specs)(g, e)

  g = ((2, 1 << 16), jnp.float32, P("data"))
  text = _compile(devices, reduce_like, [g, g], mesh_rules)
  call = _kernels(text, "tpu", ["quantize_int8_with_feedback"])["quantize_int8_with_feedback"]
  assert _operands(call)[0] == ((1 << 16) // 256, 256)  # this device's piece, rows of one block
  assert not hlo_bytes.collectives(text, mesh_rules[0])


def test_explicit_pallas_attention_is_refused_on_tpu():
  """The flash kernel is Triton's: on TPU `choose` and the op say so, rather than Mosaic failing."""
  from jaxtrain.config import ConfigError
  with pytest.raises(ConfigError, match="needs a GPU or CPU"):
    attention.choose(ModelConfig(attention="pallas"), 1024, True, True, backend="tpu")
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  ids = jnp.ones((1, 128), jnp.int32)
  with platform.target("tpu"), pytest.raises(ValueError, match="on TPU use splash"):
    jax.eval_shape(lambda q: flash_ops.flash_attention(q, q, q, ids, ids, ids, ids), q)


# ---- GPU (Triton) --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_rms_norm_compiles_for_gpu(target_devices, name):
  """Triton's route: (rows, next power of two of D) tiles, masked (768 is not a power of two)."""
  devices = target_devices(GPU)
  m, l = _model(name)
  x = ((1, l, m.d_model), jnp.bfloat16, P())
  text = _compile(devices, _rms_norm(_tokens), [x, x, ((m.d_model,), jnp.float32, P())])
  _kernels(text, "gpu", RMS_NORM)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "fp8", "int8", "int4"])
def test_quantize_compiles_for_gpu(target_devices, fmt):
  devices = target_devices(GPU)
  scale = jnp.float32(1.0) if fmt == "fp8" else None
  fn = lambda g, e: quantize_ops.quantize_with_feedback(g, e, fmt, 256, scale, impl="pallas")
  g = ((2, 1 << 16), jnp.float32, P())
  _kernels(_compile(devices, fn, [g, g]), "gpu", [f"quantize_{fmt}_with_feedback"])


SELF_SUBTRACT = re.compile(r"subtract\((%[\w.\-]+), \1\)")


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_error_feedback_keeps_its_rounding_on_gpu(target_devices, fmt):
  """XLA:GPU folds f32 -> bf16/fp8 -> f32 to the identity, so x - decode(encode(x)) compiled to
  subtract(x, x): error feedback fed back nothing (the H200 run of 2026-12-04 found the Pallas
  kernel's new error up to 1.0 / 15 away from the XLA reference). The control shows the fold on
  this compiler; compress's XLA path and the kernels' reference keep the rounding
  (wire.format.rounded)."""
  from jaxtrain.kernels.quantize import reference as quantize_reference
  from jaxtrain.optim import compress
  devices = target_devices(GPU)
  dtype = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[fmt]
  x = ((256, 512), jnp.float32, P())
  control = _compile(devices, lambda v: v - v.astype(dtype).astype(jnp.float32), [x])
  assert SELF_SUBTRACT.search(control)
  scale = jnp.float32(0.01) if fmt == "fp8" else None
  paths = {"compress": lambda g, e: compress._quantize(g, fmt, 256, scale, e, "xla")[2],
           "reference": lambda g, e: quantize_reference.quantize_with_feedback(
               g, e, fmt, 256, scale)[2]}
  for name, fn in paths.items():
    text = _compile(devices, fn, [x, x])
    assert not SELF_SUBTRACT.search(text), name
    assert re.search(rf"f32\[256,512\]\S* convert\(", text), name  # the payload decoded

@pytest.mark.parametrize("name", CONFIGS)
def test_flash_attention_compiles_for_gpu(target_devices, name):
  devices = target_devices(GPU)
  m, l = _model(name)
  q = ((1, l, m.n_heads, m.head_dim), jnp.bfloat16, P())
  kv = ((1, l, m.n_kv_heads, m.head_dim), jnp.bfloat16, P())
  text = _compile(devices, _attention(ModelConfig(attention="pallas")),
                  [q, kv, kv, ((1, l), jnp.int32, P())])
  _kernels(text, "gpu", FLASH)


@pytest.mark.parametrize("name", CONFIGS)
def test_cudnn_is_auto_and_compiles_for_gpu(target_devices, name):
  """model.attention=auto on GPU is cuDNN's flash attention for rows of one document (packed rows
  take the Pallas flash kernel: jax's cuDNN call masks by per-row lengths only)."""
  devices = target_devices(GPU)
  m, l = _model(name)
  cfg = ModelConfig(attention="auto", compute_dtype="bfloat16")  # cuDNN takes no float32
  assert attention.choose(cfg, l, False, True, backend="gpu") == "cudnn"
  assert attention.choose(cfg, l, True, True, backend="gpu") == "pallas"
  q = ((1, l, m.n_heads, m.head_dim), jnp.bfloat16, P())
  kv = ((1, l, m.n_kv_heads, m.head_dim), jnp.bfloat16, P())
  text = _compile(devices, _attention(cfg), [q, kv, kv])
  calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text)
  assert sorted(calls) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls


def _cross_entropy(m, tokens):
  layout = "VD" if m.tie_embeddings else "DV"

  def loss(x, w, targets, mask):
    ce, z, _ = ce_ops.cross_entropy(x.reshape(-1, x.shape[-1]), w, targets.reshape(-1),
                                    mask.reshape(-1), 1e-4, w_layout=layout, impl="pallas",
                                    tokens=tokens())
    return ce + z

  shape = (m.vocab_size, m.d_model) if layout == "VD" else (m.d_model, m.vocab_size)
  return jax.grad(loss, argnums=(0, 1)), shape


@pytest.mark.parametrize("name", ["gpt2_small", pytest.param("llama_8b", marks=pytest.mark.slow)])
def test_cross_entropy_compiles_for_gpu(target_devices, name):
  """gpt2_small's tied head ([V, D]) and llama_8b's untied one ([D, V]), 128K vocabulary."""
  devices = target_devices(GPU)
  m, l = _model(name)
  fn, w = _cross_entropy(m, _tokens)
  args = [((1, l, m.d_model), jnp.bfloat16, P()), (w, jnp.bfloat16, P()),
          ((1, l), jnp.int32, P()), ((1, l), jnp.float32, P())]
  _kernels(_compile(devices, fn, args), "gpu", CROSS_ENTROPY)


def test_cross_entropy_runs_per_shard_on_gpu(target_devices):
  """gpt2_small's head, 4 rows over data x fsdp: each GPU's kernels take its 1024 tokens and the
  whole (replicated) weight; nothing is gathered. The control, on replicated rows, gathers them."""
  devices = target_devices(GPU)
  m, _ = _model("gpt2_small")
  b, l = 4, 1024
  mesh_rules = _mesh(devices, data=2, fsdp=2)
  rows = P(("data", "fsdp"))
  fn, w = _cross_entropy(m, _tokens)
  args = [((b, l, m.d_model), jnp.bfloat16, rows), (w, jnp.bfloat16, P()),
          ((b, l), jnp.int32, rows), ((b, l), jnp.float32, rows)]
  text = _compile(devices, fn, args, mesh_rules)
  for line in _kernels(text, "gpu", CROSS_ENTROPY).values():
    assert _operands(line)[0] == (l, m.d_model)
  assert not _gathers(text, mesh_rules[0], b * l * m.d_model * 2 / 4)
  fn, _ = _cross_entropy(m, lambda: None)
  text = _compile(devices, fn, args, mesh_rules)
  assert _gathers(text, mesh_rules[0], b * l * m.d_model * 2 / 4)


def test_flash_attention_runs_per_shard_on_gpu(target_devices):
  """llama_1b's heads, 2 rows over data, heads over tensor: each GPU's kernels take its row, 16
  heads and 4 kv heads; no collective at all."""
  devices = target_devices(GPU)
  m, l = _model("llama_1b")
  mesh_rules = _mesh(devices, "fsdp_tp", data=2, tensor=2)
  q = ((2, l, m.n_heads, m.head_dim), jnp.bfloat16, P("data", None, "tensor"))
  kv = ((2, l, m.n_kv_heads, m.head_dim), jnp.bfloat16, P("data", None, "tensor"))
  text = _compile(devices, _attention(ModelConfig(attention="pallas")),
                  [q, kv, kv, ((2, l), jnp.int32, P("data"))], mesh_rules)
  forward = _kernels(text, "gpu", FLASH)["flash_attention_forward"]
  assert _operands(forward)[:2] == [(1, l, m.n_heads // 2, m.head_dim),
                                       (1, l, m.n_kv_heads // 2, m.head_dim)]
  assert not hlo_bytes.collectives(text, mesh_rules[0])


@pytest.mark.slow  # the train step compiles for TPU in ~80 s on two cores, kernels or not
def test_train_step_kernels_run_per_shard_on_tpu(target_devices):
  """gpt2_small with one layer, fused_norm=pallas and attention=auto (splash), 4 rows over data
  (dp: parameters replicated): the train step's kernels take one row each, and it gathers
  nothing (its collectives are the gradient's all-reduces)."""
  devices = target_devices(TPU)
  cfg = jaxtrain.get_config("configs/gpt2_small.py")
  cfg.model.update(n_layers=1, vocab_size=2048, fused_norm="pallas")
  cfg.train.update(batch_size=4)
  cfg.mesh.update(data=4, rules="dp")
  with platform.target("tpu"):
    train_fn, state, batch, mesh = builder.abstract_step(cfg, devices)
    with parallel.activate(mesh, cfg.mesh.rules):
      text = train_fn.lower(state, batch).compile().as_text()
  kernels = _kernels(text, "tpu", RMS_NORM + SPLASH)
  assert _operands(kernels["add_rms_norm_forward"])[0] == (cfg.train.seq_len, cfg.model.d_model)
  kinds = {c.kind for c in hlo_bytes.collectives(text, mesh)}
  assert kinds == {"all-reduce"}, kinds
