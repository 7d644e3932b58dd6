"""Devices of accelerators this host does not have, for ahead-of-time compilation (jaxtrain.aot):
`target_devices("tpu-v5e:2x2")` gives that slice's devices, or skips the test with the reason (the
extra that is missing) when its compiler is not installed. `make test-targets` installs both extras
in their own environment (.venv-targets) and runs this folder."""

import pathlib

import pytest

from jaxtrain.aot import targets


def pytest_collection_modifyitems(items):
  """What a target's compile holds (memory, schedules, collectives) is the optimized program's:
  every test here compiles with XLA's optimizations (tests/conftest.py turns them off elsewhere)."""
  here = pathlib.Path(__file__).parent
  for item in items:
    if here in item.path.parents:
      item.add_marker(pytest.mark.optimized)


@pytest.fixture
def target_devices():
  def get(name: str):
    target = targets.parse(name)
    why = targets.available(target.platform)
    if why:
      pytest.skip(why)
    return targets.devices(target)
  return get
