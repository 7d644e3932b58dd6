"""The backend a program is built for: the local default backend, or the target of an ahead-of-time
compile (`jaxtrain.aot`), which builds a TPU or GPU program on a CPU host.

Every choice that depends on the backend (attention and MoE implementations, Pallas's interpret
mode, a kernel's Mosaic or Triton route) reads `backend()` at trace time, never
`jax.default_backend()`: under `target("tpu")` the step traced for TPU devices is the one a TPU run
traces."""

import contextlib

import jax

_target: list[str] = []


def backend() -> str:
  """"cpu", "gpu" or "tpu": the innermost `target`, else jax's default backend."""
  return _target[-1] if _target else jax.default_backend()


@contextlib.contextmanager
def target(platform: str):
  """Trace for `platform` ("tpu", "gpu"; "cuda" and "rocm" read as "gpu") inside the block."""
  name = "gpu" if platform in ("cuda", "rocm") else platform
  if name not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"unknown platform {platform!r}")
  _target.append(name)
  try:
    yield
  finally:
    _target.pop()
