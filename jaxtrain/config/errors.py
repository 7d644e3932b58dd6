"""The config's one-line error and the two checks every section makes: a value among its choices,
and floats that are finite and within their ranges. No jax import here."""

import math


class ConfigError(ValueError):
  """A config value that cannot run; the message is one line for the user."""


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ConfigError(f"{name}: unknown value {value!r}; choose one of {', '.join(choices)}")


def check_floats(section: str, values, ranges: dict) -> None:
  """Every float in the section (a ConfigDict or dict) is finite, nan and inf are refused
  everywhere, and each key of `ranges` ({"a.b": (low, high, whether low itself is allowed)}) is
  within its range."""
  values = values.to_dict() if hasattr(values, "to_dict") else dict(values)
  for key, value in flat(values, f"{section}.").items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{key} must be a finite number, got {value}")
    if key in ranges:
      low, high, low_ok = ranges[key]
      if value < low or (value == low and not low_ok) or value > high:
        interval = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise ConfigError(f"{key} must be in {interval}, got {value}")


def flat(d: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for k, v in d.items():
    out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out
