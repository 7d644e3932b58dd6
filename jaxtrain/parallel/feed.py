"""Host batches -> global jax.Arrays: each process places only the rows its devices hold."""

import jax
import numpy as np

from jaxtrain.parallel import mesh as mesh_lib


class Feed:
  """Places this process's rows of each global batch as jax.Arrays sharded over the data axes.

  A batch is a dict of arrays of any shape whose leading axis is the batch (`[B, L]` tokens,
  `[B, 2, L]` pairs, `[B]` scalars). `lo:hi` are the global rows this process's devices hold;
  multi-host, each process builds only those."""

  def __init__(self, batch_size: int, sharding):
    self.batch_size, self.sharding = batch_size, sharding
    self._rows = {
        d: idx[0]
        for d, idx in sharding.addressable_devices_indices_map((batch_size,)).items()
    }
    self.lo = min(r.start or 0 for r in self._rows.values())
    self.hi = max(batch_size if r.stop is None else r.stop for r in self._rows.values())

  def put(self, local: dict) -> dict:
    """{key: this process's rows [hi - lo, ...]} -> {key: global [batch_size, ...] jax.Array}."""
    return {k: self._place(np.asarray(v), self.sharding) for k, v in local.items()}

  def put_many(self, locals_: list[dict]) -> dict:
    """Several batches' rows ([hi - lo, ...] each) -> {key: global [len(locals_), batch_size, ...]
    jax.Array}, the steps' axis whole on every device (a call of several steps)."""
    sharding = mesh_lib.stacked(self.sharding)
    return {k: self._place(np.stack([np.asarray(local[k]) for local in locals_]), sharding, 1)
            for k in locals_[0]}

  def _place(self, x: np.ndarray, sharding, axis: int = 0):
    """`x`, this process's rows along `axis`, as the global array laid out by `sharding`."""
    shape = (*x.shape[:axis], self.batch_size, *x.shape[axis + 1:])
    lead = (slice(None),) * axis
    shards = [
        jax.device_put(
            x[(*lead, slice((r.start or 0) - self.lo,
                            (self.batch_size if r.stop is None else r.stop) - self.lo))], d)
        for d, r in self._rows.items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)

  def batch(self, source, index: int) -> dict:
    """Global batch `index` of a random-access source (synthetic, bytes:
    `source.batch(index, lo, hi)`)."""
    return self.put(source.batch(index, self.lo, self.hi))
