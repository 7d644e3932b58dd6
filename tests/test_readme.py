"""The README says what is true: its links stay inside the repository, its claims match what the tests
measure, and its quickstart is the two commands CI relies on."""

import os
import re

from tests.fixtures import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def test_links_point_to_files_in_the_repository():
  targets = re.findall(r"\]\(([^)]+)\)", README) + re.findall(r"`((?:docs|benchmarks|tests|tools|experiments|"
                                                              r"configs|jaxtrain)/[\w./-]+\.(?:md|py))`", README)
  assert targets and "../" not in README
  missing = [t for t in targets if not os.path.exists(os.path.join(ROOT, t))]
  assert not missing, missing


def test_resume_on_another_mesh_is_not_claimed_bitwise():
  """Measured: a restore on another device count continues the run equal to ~1e-6, not bitwise (the
  reduction order changes); tests/train/test_elastic.py checks rtol 1e-5."""
  text = " ".join(README.split())
  assert "also on another mesh or device count" not in text
  assert "bitwise equal to an uninterrupted run on CPU (data order included) on the same mesh" in text
  assert "equal up to float reassociation" in text


def test_quickstart_is_two_commands_and_ci_runs_the_test_one():
  block = README.split("## Quickstart")[1].split("```")[1]
  commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
  assert commands == ["make train", "make test"]
  assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()
