"""Flash attention: Pallas kernels (kernel.py) behind a custom_vjp (ops.py), held to
reference.py."""
