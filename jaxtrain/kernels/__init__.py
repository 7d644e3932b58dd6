"""Fused operations, each in `jaxtrain/kernels/<op>/` as jax's own Pallas ops are laid out:
`reference.py` (plain jnp: the definition the tests hold every other implementation to), the
implementations (`kernel.py` a Pallas kernel, interpreted on CPU; plain-JAX ones by name), and
`ops.py` (the public function, with its `custom_vjp`, that picks one). Below `model`: kernels use no
flax modules (manual.py reaches the mesh through `collectives`, which reads flax's logical-axis
rules)."""
