"""benchmarks/kernel_checks.py: a component beyond its tolerance, or not finite, fails its check
(fast); the whole script at --small on CPU (Pallas interpreted), where every kernel and attention
implementation this backend runs is within its stated tolerance of its reference (slow, ~30 s on
2 idle cores)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kernel_checks
from jaxtrain import wire
from jaxtrain.model import attention
from tests.fixtures import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_checks.py")


def test_a_component_beyond_its_tolerance_or_not_finite_fails():
  report, s = kernel_checks.Report(), kernel_checks.SMALL
  want = np.array([1.0, -4.0])
  add = lambda check, dtype, *parts: report.add(check, s, dtype, "", parts)
  add("within", jnp.float32, ("out", want + [0, 4e-5], want, 1e-5, None))  # tol 1e-5 * 4
  add("beyond", jnp.float32, ("out", want, want, 1e-5, None),
      ("dq", want + [0, 5e-5], want, 1e-5, None))
  add("nan", jnp.bfloat16, ("out", np.array([np.nan, -4.0]), want, 1.0, None))
  add("exact", jnp.float32, ("payload", np.array([3, 7], np.uint8), np.array([3, 8], np.uint8),
                             0.0, None))
  add("sum", jnp.float32, ("ce", np.float32(100.002), np.float32(100.0), 1e-5, 100.0))
  assert [r["status"] for r in report.rows] == ["PASS", "FAIL", "FAIL", "FAIL", "FAIL"]
  assert report.rows[1]["components"]["dq"] == pytest.approx((5e-5, 4e-5))
  assert report.counts() == {"PASS": 1, "FAIL": 4, "SKIP": 0}


@pytest.mark.slow
def test_small_checks_pass_on_cpu(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": ROOT}
  out = tmp_path / "checks.json"
  result = subprocess.run([sys.executable, SCRIPT, "--small", "--json", str(out)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  rows = json.load(open(out))["checks"]
  checks = {k: {r["check"] for r in rows if r["status"] == k} for k in ("PASS", "FAIL", "SKIP")}
  assert not checks["FAIL"]
  # every implementation and wire format is checked or skipped for a stated reason; on CPU only
  # the GPU's and the TPU's own implementations are skipped
  assert checks["SKIP"] == {"attention.cudnn", "attention.splash"}
  implementations = {f"attention.{n}" for n in attention.IMPLEMENTATIONS} - checks["SKIP"]
  formats = {f"quantize.pallas.{f}" for f, spec in wire.FORMATS.items() if spec.pallas}
  kernels = {"flash_attention", "rms_norm.pallas", "cross_entropy.pallas"}
  assert checks["PASS"] == kernels | implementations | formats
  for r in rows:
    for name, (err, tol) in r["components"].items():
      assert err <= tol, (r["check"], r["dtype"], name)
  # bf16 ran and shows its rounding: an error of 0 would mean no bf16 arithmetic
  bf16 = {r["check"]: r for r in rows if r["dtype"] == "bfloat16" and r["status"] == "PASS"}
  assert kernels | {"attention.pallas"} <= set(bf16)
  assert bf16["flash_attention"]["components"]["out"][0] > 0
  counts = {k: sum(r["status"] == k for r in rows) for k in ("PASS", "SKIP")}
  last = result.stdout.strip().splitlines()[-1]
  assert last == f"{counts['PASS']} passed, 0 failed, {counts['SKIP']} skipped"
