"""tools/soak.py end to end: a 2-process run under launch with every kind of fault, survived, its
parameters bitwise the uninterrupted run's (the `long` tier: make test-long)."""

import subprocess
import sys

import pytest

from tests.fixtures import ROOT


@pytest.mark.slow
@pytest.mark.long  # ~10 min on 2 cores: calibration, the reference, the faulted run
def test_a_short_soak_survives_every_fault_with_the_reference_params(tmp_path):
  report = tmp_path / "report.md"
  done = subprocess.run([sys.executable, "tools/soak.py", "--minutes", "8", "--report", str(report)],
                        cwd=ROOT, capture_output=True, text=True, timeout=3600)
  text = report.read_text() if report.exists() else done.stdout + done.stderr
  assert done.returncode == 0, text[-4000:]
  assert "Overall: PASS" in text and "survived every fault" in text
  assert "equal the uninterrupted run's, bitwise" in text
