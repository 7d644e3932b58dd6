"""The config's one-line error and the two checks every section makes: a value among its choices, and
a float that is finite and within its range. No jax import here."""

import math


class ConfigError(ValueError):
  """A config value that cannot run; the message is one line for the user."""


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ConfigError(f"{name}: unknown value {value!r}; choose one of {', '.join(choices)}")


def check_floats(section: str, values: dict, ranges: dict) -> None:
  """Every float of the section is finite (nan and inf are refused everywhere) and each key of `ranges`
  ({"a.b": (low, high, whether low itself is allowed)}) within its range."""
  for key, value in values.items():
    name = f"{section}.{key}"
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{name} must be a finite number, got {value}")
    if name in ranges:
      low, high, low_ok = ranges[name]
      if value < low or (value == low and not low_ok) or value > high:
        interval = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise ConfigError(f"{name} must be in {interval}, got {value}")
