"""Devices of accelerators this host does not have, for ahead-of-time compilation (jaxtrain.aot):
`target_devices("tpu-v5e:2x2")` gives that slice's devices, or skips the test with the reason (the
extra that is missing) when its compiler is not installed. `make test-targets` installs both extras
in their own environment (.venv-targets) and runs this folder."""

import pytest

from jaxtrain.aot import targets


@pytest.fixture
def target_devices():
  def get(name: str):
    target = targets.parse(name)
    why = targets.available(target.platform)
    if why:
      pytest.skip(why)
    return targets.devices(target)
  return get
