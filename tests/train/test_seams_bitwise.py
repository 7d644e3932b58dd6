"""Behaviour unchanged across refactors: the first 30 losses and the eval loss of tiny, moe_tiny (2 data x
4 expert) and text_tiny equal, bit for bit, those recorded before the seams refactor
(tests/train/seams_reference.py says how they were recorded)."""

import json

import pytest

from tests.train import seams_reference as ref

# recorded with XLA's optimizations (tests/conftest.py turns them off for the rest)
pytestmark = pytest.mark.optimized


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("seams"))
  return tmp, ref.configs(tmp)


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
@pytest.mark.parametrize("name", ["tiny", "moe_tiny", "text_tiny"])
def test_losses_bitwise_equal_to_before_the_seams(runs, name):
  with open(ref.FIXTURE) as f:
    recorded = json.load(f)
  key = ref.reference_key(recorded)
  if key is None:
    pytest.skip("no reference recorded on this kind of CPU "
                "(tests/train/seams_reference.py says how)")
  want = recorded[key][name]
  tmp, cfgs = runs
  got = ref.losses(cfgs[name], f"{tmp}/{name}")
  assert len(got["loss"]) == ref.STEPS
  assert got == want  # floats from JSON: equal means bitwise equal float32 values
