"""Which of the cross-entropy implementations (pallas, full, chunked) is nearer float64 truth in
float32, at gpt2_small's shapes (2048 x 768, V 50304, tied), with and without the z-loss: the
gradient in the hidden states of 512 rows against numpy's float64 (benchmarks/RESULTS.md, H200
2026-12-04).

  python benchmarks/ce_precision.py"""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from jaxtrain.kernels.cross_entropy import ops as ce
n, d, v = 2048, 768, 50304
k = jax.random.split(jax.random.key(4), 4)
x = jax.random.normal(k[0], (n, d)); w = jax.random.normal(k[1], (v, d)) * d ** -0.5
t = jax.random.randint(k[2], (n,), 0, v)
m = (jax.random.uniform(k[3], (n,)) > 0.25).astype(jnp.float32)
rows = 512
xs, ws = np.asarray(x[:rows], np.float64), np.asarray(w, np.float64)
ts, ms = np.asarray(t[:rows]), np.asarray(m[:rows], np.float64)
logits = xs @ ws.T
mx = logits.max(1, keepdims=True)
lse = (mx + np.log(np.exp(logits - mx).sum(1, keepdims=True)))[:, 0]
p = np.exp(logits - lse[:, None])
for zl in (1e-2, 0.0):
  dlog = (1 + zl * lse)[:, None] * p
  dlog[np.arange(rows), ts] -= 1.0
  truth = (ms[:, None] * dlog) @ ws
  scale = np.abs(truth).max()
  def loss(impl, x, w):
    a, z, _ = ce.cross_entropy(x, w, t, m, zl, w_layout="VD", impl=impl)
    return a + 0.5 * z
  with jax.default_matmul_precision("highest"):
    for impl in ("pallas", "full", "chunked"):
      dx = np.asarray(jax.jit(jax.grad(functools.partial(loss, impl)))(x, w)[:rows], np.float64)
      err = np.abs(dx - truth)
      print(f"z_loss {zl}: {impl:8s} dx max err vs float64 {err.max():.2e} "
            f"({err.max() / scale:.1e} of max {scale:.3f}), mean {err.mean():.1e}", flush=True)
