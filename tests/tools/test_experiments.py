"""experiments/: every study's configs build and validate on 8 devices; every study has its README and is listed."""

import ast
import glob
import importlib.util
import os

import pytest

from jaxtrain import config as config_lib
from tests.fixtures import ROOT

EXPERIMENTS = os.path.join(ROOT, "experiments")
STUDIES = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(EXPERIMENTS, "*", "README.md")))


def defines_get_config(path: str) -> bool:
  tree = ast.parse(open(path).read())
  return any(isinstance(node, ast.FunctionDef) and node.name == "get_config" for node in tree.body)


# every file of a study that defines get_config is a config, whatever its name
CONFIGS = sorted(p for p in glob.glob(os.path.join(EXPERIMENTS, "*", "*.py")) if defines_get_config(p))


def load(path: str):
  spec = importlib.util.spec_from_file_location(f"_experiment_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, EXPERIMENTS))
def test_config_builds_and_validates(path):
  module = load(path)
  args = getattr(module, "ARGS", (None,))  # a sweep's points, or the config alone
  configs = [module.get_config(arg) for arg in args]
  for cfg in configs:
    assert set(cfg) == set(config_lib.default_config())
    config_lib.validate(cfg, 8)
  assert len({cfg.to_json() for cfg in configs}) == len(args)  # each point is a different run


def test_every_study_has_configs_a_readme_and_a_listing():
  assert STUDIES and CONFIGS
  assert {os.path.basename(os.path.dirname(p)) for p in CONFIGS} == set(STUDIES)
  listing = open(os.path.join(EXPERIMENTS, "README.md")).read()
  for study in STUDIES:
    readme = open(os.path.join(EXPERIMENTS, study, "README.md")).read()
    assert all(f"## {part}" in readme for part in ("Question", "Result", "Rerun")), study
    assert f"]({study}/)" in listing, study
