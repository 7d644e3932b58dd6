"""The preference losses and their gradients equal direct numpy formulas on small fixed inputs."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.posttrain import preference

RNG = np.random.default_rng(0)
PC, PR, RC, RR = (RNG.normal(size=5) * 3 for _ in range(4))
LC, LR = np.array([1., 3, 4, 7, 2]), np.array([2., 1, 5, 3, 6])


def sig(x):
  return 1 / (1 + np.exp(-x))


def logistic_np(z, eps):
  """Loss -(1-eps) log sig(z) - eps log sig(-z) and its derivative in z."""
  return -(1 - eps) * np.log(sig(z)) - eps * np.log(sig(-z)), -(1 - eps) * sig(-z) + eps * sig(z)


def grads(f, *args):
  """Per-pair loss, and the gradient of their sum with respect to each array argument."""
  args = [jnp.asarray(a, jnp.float64) for a in args]
  loss = f(*args)
  g = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=tuple(range(len(args))))(*args)
  return np.asarray(loss), [np.asarray(x) for x in g]


def test_bradley_terry():
  with jax.enable_x64():
    for eps in (0.0, 0.1):
      loss, (gc, gr) = grads(lambda c, r: preference.bradley_terry(c, r, eps), PC, PR)
      want, dz = logistic_np(PC - PR, eps)
      np.testing.assert_allclose(loss, want, rtol=1e-12)
      np.testing.assert_allclose(gc, dz, rtol=1e-12)
      np.testing.assert_allclose(gr, -dz, rtol=1e-12)


def test_dpo():
  with jax.enable_x64():
    for beta, eps in ((0.1, 0.0), (0.5, 0.2)):
      loss, (gpc, gpr, grc, grr) = grads(lambda *a: preference.dpo(*a, beta, eps), PC, PR, RC, RR)
      want, dz = logistic_np(beta * ((PC - RC) - (PR - RR)), eps)
      np.testing.assert_allclose(loss, want, rtol=1e-12)
      np.testing.assert_allclose(gpc, beta * dz, rtol=1e-12)
      np.testing.assert_allclose(gpr, -beta * dz, rtol=1e-12)
      np.testing.assert_allclose(grc, -beta * dz, rtol=1e-12)
      np.testing.assert_allclose(grr, beta * dz, rtol=1e-12)


def test_ipo():
  with jax.enable_x64():
    beta = 0.25
    loss, (gpc, gpr, _, _) = grads(lambda *a: preference.ipo(*a, beta), PC, PR, RC, RR)
    h = (PC - RC) - (PR - RR)
    np.testing.assert_allclose(loss, (h - 2.0) ** 2, rtol=1e-12)
    np.testing.assert_allclose(gpc, 2 * (h - 2.0), rtol=1e-12)
    np.testing.assert_allclose(gpr, -2 * (h - 2.0), rtol=1e-12)


def test_simpo():
  with jax.enable_x64():
    beta, gamma, eps = 2.0, 0.5, 0.1
    loss, (gc, gr) = grads(lambda c, r: preference.simpo(c, r, LC, LR, beta, gamma, eps), PC, PR)
    want, dz = logistic_np(beta * (PC / LC - PR / LR) - gamma, eps)
    np.testing.assert_allclose(loss, want, rtol=1e-12)
    np.testing.assert_allclose(gc, beta / LC * dz, rtol=1e-12)
    np.testing.assert_allclose(gr, -beta / LR * dz, rtol=1e-12)


def test_large_margins_stay_finite():
  big = jnp.array([300.0, -300.0])
  assert np.isfinite(np.asarray(preference.bradley_terry(big, -big, 0.1))).all()
  assert np.isfinite(np.asarray(jax.grad(lambda c: preference.dpo(c, -c, 0 * c, 0 * c, 1.0).sum())(big))).all()
