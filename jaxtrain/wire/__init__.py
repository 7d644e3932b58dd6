"""Wire formats of the compressed collectives (jaxtrain/optim/compress.py, diloco.py), in one table
that the XLA composition (optim/quantize.py), the Pallas kernel (kernels/quantize) and the planner's
byte counts (plan/estimate.py) read. Each format is one file; its docstring states its round-trip
bound, which tests/wire/test_formats.py holds it to. Every payload is an unsigned integer array (or
float32), so that a collective moves exactly the bytes the format claims: XLA:CPU widens
bf16/fp8/s4 collectives, but not u8/u16 (docs/ARCHITECTURE.md, pitfalls)."""

from jaxtrain.config import ConfigError
from jaxtrain.wire import bf16, f32, fp8, int4, int8
from jaxtrain.wire.format import Format

FORMATS = {"f32": f32.FORMAT, "bf16": bf16.FORMAT, "fp8": fp8.FORMAT, "int8": int8.FORMAT,
           "int4": int4.FORMAT}


def check(key: str, name: str) -> None:
  """ConfigError (one line) unless `name`, the value of config key `key`, is a wire format."""
  if name not in FORMATS:
    raise ConfigError(f"{key}={name!r}: choose one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "Format", "check"]
