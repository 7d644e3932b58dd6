"""Shared test helpers: the repository root, a tiny config, random-access batches on a mesh."""

import os

from jaxtrain.config import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**sections):
  """A very small model config for property tests; `sections` update config sections."""
  c = default_config()
  c.model.update(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                 max_seq_len=32)
  c.data.update(symbols=40, max_symbols=12, stop_prob=0.2)
  c.train.update(steps=4, batch_size=8, seq_len=16, log_every=1, eval_every=0, eval_batches=1)
  c.optim.update(warmup_steps=1, lr=1e-2)
  c.mesh.update(data=-1)
  for name, values in sections.items():
    c[name].update(values)
  return c


class Batches:
  """Random access to global batch `index` of a source (synthetic, bytes) placed on a mesh:
  `batches(index)` -> dict of global jax.Arrays."""

  def __init__(self, source, batch_size: int, sharding):
    from jaxtrain import parallel
    self.source, self.feed = source, parallel.Feed(batch_size, sharding)

  def __call__(self, index: int) -> dict:
    return self.feed.batch(self.source, index)


def _cpuinfo(key: str) -> str:
  """The first value of `key` in /proc/cpuinfo, "unknown" where there is none."""
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f
                   if line.split(":")[0].strip() == key), "unknown")
  except OSError:
    return "unknown"


def cpu_vendor() -> str:
  """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), "unknown" where there is none."""
  return _cpuinfo("vendor_id")


def cpu_kind() -> str:
  """The vendor and the processor generation ("AuthenticAMD family 25 model 17"): XLA:CPU's code,
  and so the last bit of a float, differs between generations of one vendor too (AMD EPYC hosts of
  two models differed from tiny's fourth step on)."""
  return f"{cpu_vendor()} family {_cpuinfo('cpu family')} model {_cpuinfo('model')}"
