"""Config files and command-line overrides: `configs/NAME.py[:ARG]` -> ConfigDict, and
`--config.a.b=V` applied typed as the default. No jax import here (the CLI parses flags before jax
loads)."""

import importlib.resources
import importlib.util
import os

import ml_collections

from jaxtrain.config import AUTO, AUTO_KEYS, ConfigError


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """`path/to/NAME.py[:ARG]` -> the file's get_config(ARG) (ARG is None when absent). A path that
  does not exist but names a config shipped with jaxtrain (`configs/tiny.py`, `tiny.py` or `tiny`)
  loads that one."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    path = _shipped_config(path)
  module_spec = importlib.util.spec_from_file_location(f"_jaxtrain_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config: {path} has no get_config(arg) function")
  return module.get_config(arg or None)


def _shipped_config(path: str) -> str:
  """The file of a config shipped in the package (jaxtrain.configs, the repository's configs/)."""
  name = os.path.basename(path)
  name = name if name.endswith(".py") else f"{name}.py"
  shipped = importlib.resources.files("jaxtrain.configs") / name
  if os.path.dirname(path) not in ("", "configs") or not shipped.is_file():
    raise ConfigError(f"--config: no such file {path!r}")
  return str(shipped)


def _parse_value(key: str, text: str, current):
  """`text` as the type of the current value; one-line ConfigError when it does not fit."""
  if isinstance(current, bool):
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ConfigError(f"--config.{key}: expected true or false, got {text!r}")
  for kind in (int, float):
    if isinstance(current, kind):
      try:
        return kind(text) if kind is float else int(text, 0)
      except ValueError:
        raise ConfigError(f"--config.{key}: expected {kind.__name__}, got {text!r}") from None
  return text


def apply_overrides(cfg: ml_collections.ConfigDict,
                    overrides: dict[str, str]) -> ml_collections.ConfigDict:
  """Sets dotted keys from strings, typed as their defaults; unknown keys are refused."""
  for key, text in overrides.items():
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
      if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
        raise ConfigError(f"--config.{key}: unknown config key")
      node = node[part]
    if leaf not in node or isinstance(node[leaf], ml_collections.ConfigDict):
      raise ConfigError(f"--config.{key}: unknown config key")
    if text == AUTO and key in AUTO_KEYS:  # an int key that the planner may choose
      with node.ignore_type():
        node[leaf] = text
      continue
    node[leaf] = _parse_value(key, text, node[leaf])
  return cfg
