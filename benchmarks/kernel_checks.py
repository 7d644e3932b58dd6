"""Numerics of the kernels and attention implementations against their plain-jnp references,
forward and gradients, at the shipped configs' shapes: the accelerator's check
(benchmarks/device_checks.sh).

  python benchmarks/kernel_checks.py [--configs gpt2_small,llama_1b] [--json FILE] [--small]
      [--only flash_attention,rms_norm,cross_entropy,attention,quantize]

Checked in float32 and bfloat16, through the public functions only (they pick Triton on GPU and
interpret mode on CPU by kernels/platform.backend()): kernels/flash_attention (packed rows with
padding, permuted as context parallelism permutes them), kernels/rms_norm (pallas),
kernels/cross_entropy (pallas: z-loss, a token mask, the config's head layout), every implementation
of model/attention.IMPLEMENTATIONS that `choose` runs on this backend, on packed (documents +
padding) and unpacked rows (cudnn: unpacked, bf16 only; splash: TPU only), and kernels/quantize
(pallas, every wire format with a kernel, float32 only: it runs on gradients).

Shapes: the config's seq_len, heads, kv heads, head dim, width, vocabulary and d_ff (quantize: the
[D, F] gradient of an MLP weight, blocks of comm.block = 256); B = max(1, 2048 // seq_len) rows, so
the float32 references' [B, H, L, L] scores and [N, V] logits stay near 1 GB. --small: 2 rows of 100
tokens, 4 heads over 2 kv heads of 24, width 40, vocabulary 101, d_ff 96, blocks of 16-32 (no length
a multiple of its block), the attention implementations on packed rows in float32 and unpacked rows
in bfloat16 only (half their compiles): CPU in under a minute (tests/tools/test_kernel_checks.py).

Tolerances, each a fraction of the largest reference value (tol = fraction x max|ref|):
- float32: 1e-5 (reassociation only). Kernel and reference are both traced under
  jax.default_matmul_precision("highest"): on GPU a float32 dot otherwise runs in TF32 (XLA's and
  Triton's default), 10 mantissa bits, which no 1e-5 bound holds.
- bfloat16 attention: 1e-2 against the float32 reference of the same bf16 inputs (the output and
  each tile of probabilities round to 8 bits; measured 4e-3 on CPU,
  tests/kernels/test_flash_attention.py).
- bfloat16 rms_norm and cross-entropy: against the reference run in bf16, outputs and gradients to
  2^-7 (one bf16 ulp: float32 sums that differ in their last bits round to neighbouring values), the
  cross-entropy sums to 1e-5 in both dtypes, the residual sum h and the token count exactly
  (tests/kernels/test_rms_norm.py, test_cross_entropy_kernel.py).
- quantize: 0, bit for bit the jitted reference (payload, scales, new error).
Attention outputs are compared on queries that attend a key (xla averages all values for a query
that attends none, the reference gives zeros), with the cotangent zero on the others, as a loss mask
makes it. Exit status 1 when a check fails or raises (a kernel that does not lower), else 0; skips
are no failure.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxtrain import config_files, wire  # noqa: E402
from jaxtrain.config import ConfigError, ModelConfig  # noqa: E402
from jaxtrain.kernels import platform  # noqa: E402
from jaxtrain.kernels.attention import reference as attention_reference  # noqa: E402
from jaxtrain.kernels.cross_entropy import ops as ce_ops  # noqa: E402
from jaxtrain.kernels.flash_attention import ops as flash_ops  # noqa: E402
from jaxtrain.kernels.quantize import ops as quantize_ops  # noqa: E402
from jaxtrain.kernels.quantize import reference as quantize_reference  # noqa: E402
from jaxtrain.kernels.rms_norm import ops as rms_ops, reference as rms_reference  # noqa: E402
from jaxtrain.model import attention  # noqa: E402

TOKENS = 2048  # rows per check: max(1, TOKENS // seq_len)
QUANTIZE_BLOCK = 256  # comm.block's default
ATTENTION = {"float32": 1e-5, "bfloat16": 1e-2}
ROUNDED = {"float32": 1e-5, "bfloat16": 2 ** -7}  # rms_norm, cross-entropy outputs and gradients
SUMS = 1e-5  # cross-entropy's ce and z, relative to their own value
Z_LOSS = 1e-2
DTYPES = (jnp.float32, jnp.bfloat16)
# --small: blocks smaller than the shapes, so every kernel runs several (partial) tiles
SMALL_BLOCKS = {"flash_attention": dict(block_q=32, block_k=32), "rms_norm": dict(block_rows=32),
                "cross_entropy": dict(block_n=16, block_v=32, block_d=16),
                "quantize": dict(rows_per_program=3)}


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What one target's checks run at: B rows of L tokens, H heads over G kv heads of K, width D,
  vocabulary V, MLP width F; `model` for the attention implementations (attention_block)."""
  name: str
  b: int
  l: int
  h: int
  g: int
  k: int
  d: int
  v: int
  f: int
  layout: str  # the head's weight: "VD" (tied embedding) or "DV"
  eps: float
  model: ModelConfig
  small: bool = False

  def blocks(self, kernel: str) -> dict:
    return SMALL_BLOCKS[kernel] if self.small else {}


SMALL = Shapes("small", 2, 100, 4, 2, 24, 40, 101, 96, "VD", 1e-6, ModelConfig(attention_block=32),
               small=True)


def config_shapes(name: str) -> Shapes:
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  m, l = cfg.model, cfg.train.seq_len
  return Shapes(name, max(1, TOKENS // l), l, m.n_heads, m.n_kv_heads, m.head_dim, m.d_model,
                m.vocab_size, m.d_ff, "VD" if m.tie_embeddings else "DV", m.norm_eps,
                ModelConfig.from_config(m))


class Report:
  """One line per check (PASS / FAIL / SKIP): each component's max abs error against its
  tolerance."""

  def __init__(self):
    self.rows = []

  def add(self, check: str, s: Shapes, dtype, case: str, parts) -> None:
    """`parts`: (name, got, want, fraction, scale) with scale None = max|want|."""
    components, ok = {}, True
    for name, got, want, fraction, scale in parts:
      x, y = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
      tol = fraction * float(np.abs(y).max() if scale is None else scale)
      finite = np.isfinite(x).all() and x.shape == y.shape
      err = float(np.abs(x - y).max()) if finite else np.inf
      components[name] = (err, tol)
      ok &= err <= tol
    detail = "  ".join(f"{n} {e:.1e}/{t:.1e}" for n, (e, t) in components.items())
    self._row("PASS" if ok else "FAIL", check, s, dtype, case, detail, components)

  def skip(self, check: str, s: Shapes, dtype, case: str, reason: str) -> None:
    self._row("SKIP", check, s, dtype, case, reason)

  def error(self, check: str, s: Shapes, dtype, case: str, exc: Exception) -> None:
    lines = [x for x in str(exc).splitlines() if x.strip()] or [type(exc).__name__]
    traceback.print_exc(file=sys.stderr)
    self._row("FAIL", check, s, dtype, case, f"raised {type(exc).__name__}: {lines[0][:200]}")

  def _row(self, status, check, s, dtype, case, detail, components=None):
    dtype = jnp.dtype(dtype).name
    print(f"{status}  {check:<24} {s.name:<11} {dtype:<9} {case:<16} {detail}", flush=True)
    self.rows.append({"status": status, "check": check, "config": s.name, "dtype": dtype,
                      "case": case, "detail": detail, "components": components or {}})

  def counts(self) -> dict:
    return {k: sum(r["status"] == k for r in self.rows) for k in ("PASS", "FAIL", "SKIP")}


def precision(dtype):
  """float32: IEEE dots (GPU default is TF32); bfloat16 runs as training runs it."""
  return (jax.default_matmul_precision("highest") if jnp.dtype(dtype) == jnp.float32 else
          contextlib.nullcontext())


def jit(fn, **kwargs):
  """jax.jit; on CPU at XLA's lowest optimization: interpret mode is a scan over the grid, and XLA's
  optimizations only slow its compile (as tests/kernels do)."""
  options = {"xla_backend_optimization_level": 0} if platform.backend() == "cpu" else None
  return jax.jit(fn, compiler_options=options, **kwargs)


def _vjp(fn, primals, cotangent):
  """fn(*primals) and the cotangent pulled back to every primal."""
  out, pull = jax.vjp(fn, *primals)
  return out, *pull(cotangent)


# ---- attention: the flash kernel and every implementation ----

def _packed_rows(rng, b, n, docs, pad):
  """Segment ids [b, n]: `docs` documents of random lengths, then `pad` padding tokens (segment
  0)."""
  segment = np.zeros((b, n), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, n - pad), docs - 1, replace=False))
    segment[row, :n - pad] = 1 + np.searchsorted(cuts, np.arange(n - pad), side="right")
  return segment


def attention_inputs(s: Shapes, dtype, packed: bool, permuted: bool, seed: int = 0):
  """((q, k, v), (q_segment, k_segment, q_index, k_index), dout, sees [B, L]): self-attention
  inputs; dout is zero on queries that attend no key (padding)."""
  rng = np.random.default_rng(seed)
  b, l = s.b, s.l
  segment = _packed_rows(rng, b, l, 3, l // 8) if packed else np.ones((b, l), np.int32)
  index = np.tile(np.arange(l, dtype=np.int32), (b, 1))
  if permuted:  # context parallelism's order: rows permuted, causality by the original index
    order = np.stack([rng.permutation(l) for _ in range(b)])
    segment, index = np.take_along_axis(segment, order, 1), np.take_along_axis(index, order, 1)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  arrays = (normal(b, l, s.h, s.k), normal(b, l, s.g, s.k), normal(b, l, s.g, s.k))
  segment, index = jnp.asarray(segment), jnp.asarray(index)
  ids = (segment, segment, index, index)
  sees = attention_reference.mask(*ids).any(axis=-1)
  return arrays, ids, normal(b, l, s.h, s.k) * sees[:, :, None, None].astype(dtype), sees


@functools.cache
def _attention_vjp(fn):
  """jitted (arrays, ids, dout) -> (out, dq, dk, dv) of fn(q, k, v, *ids)."""
  return jit(lambda arrays, ids, dout: _vjp(lambda q, k, v: fn(q, k, v, *ids), arrays, dout))


def reference_attention(arrays, ids, dout):
  """The reference's (out, dq, dk, dv) in float32 on the same (possibly bf16) inputs."""
  f32 = lambda x: x.astype(jnp.float32)
  with precision(jnp.float32):
    return _attention_vjp(attention_reference.attention)(tuple(map(f32, arrays)), ids, f32(dout))


def _attention_parts(got, want, sees, dtype):
  mask = sees[:, :, None, None]
  fraction = ATTENTION[jnp.dtype(dtype).name]
  out = ("out", jnp.where(mask, got[0].astype(jnp.float32), 0), jnp.where(mask, want[0], 0),
         fraction, None)
  grads = zip(("dq", "dk", "dv"), got[1:], want[1:])
  return [out] + [(n, x, y, fraction, None) for n, x, y in grads]


def check_flash(report: Report, s: Shapes, dtype) -> None:
  arrays, ids, dout, sees = attention_inputs(s, dtype, packed=True, permuted=True, seed=1)
  fn = functools.partial(flash_ops.flash_attention, **s.blocks("flash_attention"))
  with precision(dtype):
    got = _attention_vjp(fn)(arrays, ids, dout)
  want = reference_attention(arrays, ids, dout)
  report.add("flash_attention", s, dtype, "packed+permuted",
             _attention_parts(got, want, sees, dtype))


def attention_skip(name: str, s: Shapes, dtype, packed: bool) -> str:
  """Why implementation `name` does not run such a batch here ("" when it does): `choose`'s
  rules."""
  try:
    chosen = attention.choose(dataclasses.replace(s.model, attention=name), s.l, packed=packed,
                              in_order=True)
  except ConfigError as e:
    return str(e)
  if chosen != name:
    return f"choose runs {chosen} for {'packed' if packed else 'unpacked'} batches"
  if name == "cudnn" and jnp.dtype(dtype) != jnp.bfloat16:
    return "cuDNN flash attention takes bf16/fp16 only (training computes in bf16)"
  return ""


def check_attention_implementations(report: Report, s: Shapes, dtype) -> None:
  cases = (("packed", True), ("unpacked", False))
  if s.small:  # half the compiles: packed rows in float32, unpacked in bfloat16
    cases = cases[:1] if jnp.dtype(dtype) == jnp.float32 else cases[1:]
  for case, packed in cases:
    arrays, ids, dout, sees = attention_inputs(s, dtype, packed=packed, permuted=False, seed=2)
    want = None
    for name, implementation in attention.IMPLEMENTATIONS.items():
      check = f"attention.{name}"
      reason = attention_skip(name, s, dtype, packed)
      if reason:
        report.skip(check, s, dtype, case, reason)
        continue
      try:
        want = reference_attention(arrays, ids, dout) if want is None else want
        fn = functools.partial(implementation, cfg=s.model)
        with precision(dtype):
          got = _attention_vjp(fn)(arrays, ids, dout)
        report.add(check, s, dtype, case, _attention_parts(got, want, sees, dtype))
      except Exception as e:  # a failure of one implementation does not stop the others
        report.error(check, s, dtype, case, e)


# ---- residual add + RMSNorm ----

def check_rms_norm(report: Report, s: Shapes, dtype) -> None:
  k = jax.random.split(jax.random.key(3), 5)
  shape = (s.b * s.l, s.d)
  normal = lambda key, scale=1.0: (scale * jax.random.normal(key, shape)).astype(dtype)
  x, residual, cotangent = normal(k[0]), normal(k[1], 3.0), (normal(k[3]), normal(k[4]))
  scale_D = 1 + 0.2 * jax.random.normal(k[2], (s.d,))
  blocks = s.blocks("rms_norm")
  kernel = lambda x, r, w: rms_ops.add_rms_norm(x, r, w, s.eps, impl="pallas", **blocks)
  ref = lambda x, r, w: rms_reference.add_rms_norm(x, r, w, s.eps)
  run = jit(_vjp, static_argnums=0)
  with precision(dtype):
    (normed, h), *grads = run(kernel, (x, residual, scale_D), cotangent)
    (want_normed, want_h), *want_grads = run(ref, (x, residual, scale_D), cotangent)
  fraction = ROUNDED[jnp.dtype(dtype).name]
  parts = [("normed", normed, want_normed, fraction, None), ("h", h, want_h, 0.0, None)]
  parts += [(n, a, b, fraction, None)
            for n, a, b in zip(("dx", "dresidual", "dscale"), grads, want_grads)]
  report.add("rms_norm.pallas", s, dtype, f"{shape[0]}x{shape[1]}", parts)


# ---- output projection + cross-entropy ----

def check_cross_entropy(report: Report, s: Shapes, dtype) -> None:
  n = s.b * s.l
  k = jax.random.split(jax.random.key(4), 4)
  x_ND = jax.random.normal(k[0], (n, s.d)).astype(dtype)
  w_shape = (s.v, s.d) if s.layout == "VD" else (s.d, s.v)
  w = (jax.random.normal(k[1], w_shape) * s.d ** -0.5).astype(dtype)  # logits ~ N(0, 1)
  targets_N = jax.random.randint(k[2], (n,), 0, s.v)
  mask_N = (jax.random.uniform(k[3], (n,)) > 0.25).astype(jnp.float32)

  def loss(impl, x, w):
    blocks = s.blocks("cross_entropy") if impl == "pallas" else {}
    ce, z, tokens = ce_ops.cross_entropy(x, w, targets_N, mask_N, Z_LOSS, w_layout=s.layout,
                                         impl=impl, **blocks)
    return ce + 0.5 * z, (ce, z, tokens)

  def sums_and_grads(impl, x, w):
    return jax.value_and_grad(functools.partial(loss, impl), (0, 1), has_aux=True)(x, w)

  run = jit(sums_and_grads, static_argnums=0)
  with precision(dtype):
    (_, got), (dx, dw) = run("pallas", x_ND, w)
    (_, want), (want_dx, want_dw) = run("full", x_ND, w)
  fraction = ROUNDED[jnp.dtype(dtype).name]
  parts = [("ce", got[0], want[0], SUMS, abs(float(want[0]))),
           ("z", got[1], want[1], SUMS, abs(float(want[1]))),
           ("tokens", got[2], want[2], 0.0, None),
           ("dx", dx, want_dx, fraction, None), ("dw", dw, want_dw, fraction, None)]
  report.add("cross_entropy.pallas", s, dtype, f"{n}x{s.d}, V {s.v} {s.layout}", parts)


# ---- error feedback + quantization ----

def check_quantize(report: Report, s: Shapes) -> None:
  block = 32 if s.small else QUANTIZE_BLOCK
  rng = np.random.default_rng(5)
  shape = (s.d, s.f)
  # gradients whose magnitude changes by orders of magnitude from block to block
  mags = 10.0 ** rng.uniform(-4, 2, size=(s.d, s.f // block, 1))
  g = rng.standard_normal((s.d, s.f // block, block)) * mags
  g = jnp.asarray(g.reshape(shape), jnp.float32)
  error = jnp.asarray(1e-3 * rng.standard_normal(shape), jnp.float32)
  case = f"{s.d}x{s.f}, block {block}"
  for fmt, spec in wire.FORMATS.items():
    check = f"quantize.pallas.{fmt}"
    if not spec.pallas:
      report.skip(check, s, jnp.float32, case, f"{fmt} has no Pallas kernel")
      continue
    try:
      scale = wire.fp8.shared_scale(jnp.max(jnp.abs(g + error))) if fmt == "fp8" else None
      kernel = jit(lambda g, e, scale: quantize_ops.quantize_with_feedback(
          g, e, fmt, block, scale, impl="pallas", **s.blocks("quantize")))
      ref = jit(lambda g, e, scale: quantize_reference.quantize_with_feedback(
          g, e, fmt, block, scale))
      got, want = kernel(g, error, scale), ref(g, error, scale)
      parts = [(n, a, b, 0.0, None) for n, a, b in zip(("payload", "scales", "error"), got, want)
               if b is not None]
      report.add(check, s, jnp.float32, case, parts)
    except Exception as e:
      report.error(check, s, jnp.float32, case, e)


GROUPS = ("flash_attention", "rms_norm", "cross_entropy", "attention", "quantize")


def run_checks(report: Report, s: Shapes, only=GROUPS) -> None:
  for dtype in DTYPES:
    for check, fn in (("flash_attention", check_flash), ("rms_norm.pallas", check_rms_norm),
                      ("cross_entropy.pallas", check_cross_entropy)):
      if check.split(".")[0] not in only:
        continue
      try:
        fn(report, s, dtype)
      except Exception as e:  # one kernel that fails to lower or run does not stop the others
        report.error(check, s, dtype, "", e)
    if "attention" in only:
      check_attention_implementations(report, s, dtype)
  if "quantize" in only:
    check_quantize(report, s)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--configs", default="gpt2_small,llama_1b",
                 help="configs whose shapes are checked")
  p.add_argument("--small", action="store_true",
                 help="tiny shapes instead of the configs' (CPU, interpreted)")
  p.add_argument("--json", default="", help="also write every check's errors and tolerances here")
  p.add_argument("--only", default=",".join(GROUPS),
                 help=f"comma-separated groups of checks to run, of {','.join(GROUPS)}")
  args = p.parse_args(argv)
  only = args.only.split(",")
  if not set(only) <= set(GROUPS):
    p.error(f"--only takes groups of {','.join(GROUPS)}")
  targets = [SMALL] if args.small else [config_shapes(n) for n in args.configs.split(",")]
  device = jax.devices()[0].device_kind
  print(f"# kernel checks: backend {platform.backend()} ({device}), jax {jax.__version__}; "
        f"columns: component max-abs-error/tolerance", flush=True)
  report = Report()
  for s in targets:
    print(f"# {s.name}: B {s.b} x L {s.l}, heads {s.h}/{s.g} of {s.k}, D {s.d}, V {s.v} "
          f"({s.layout}), F {s.f}", flush=True)
    run_checks(report, s, only)
  counts = report.counts()
  print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"backend": platform.backend(), "device": device, "jax": jax.__version__,
                 "checks": report.rows}, f, indent=1)
  return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
  sys.exit(main())
