"""The code sandbox (eval/sandbox.py): passing, failing, hanging, forking, memory-hungry and
network-using programs each end quickly with the right verdict and leave no process behind; pass@k
(eval/metrics.py) against a hand computation and the combinatorial formula."""

import math
import os
import time

import pytest

from jaxtrain.eval import metrics, sandbox


def gone(pid: int) -> bool:
  """No process is left in the group the sandbox started (its leader's pid)."""
  try:
    os.killpg(pid, 0)
  except ProcessLookupError:
    return True
  return False


@pytest.mark.parametrize("source, status, in_stderr", [
    ("def add(a, b):\n  return a + b\nassert add(2, 3) == 5\n", "passed", ""),
    ("def add(a, b):\n  return a - b\nassert add(2, 3) == 5\n", "failed", "AssertionError"),
    ("x = bytearray(2 << 30)\n", "failed", "MemoryError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n", "failed",
     "network access is disabled"),
    ("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n", "failed",
     "network access is disabled"),
    # an empty environment (LC_CTYPE: Python's own C-locale coercion), a writable working directory
    ("import os\nassert set(os.environ) <= {'LC_CTYPE'}, dict(os.environ)\n"
     "open('scratch.txt', 'w').write('ok')\n", "passed", ""),
])
def test_verdicts(source, status, in_stderr):
  verdict = sandbox.run_program(source, timeout_s=5.0)
  assert (verdict.status, verdict.passed) == (status, status == "passed"), verdict.stderr
  assert in_stderr in verdict.stderr
  assert verdict.seconds < 4.0


def test_a_hanging_program_is_killed_at_the_time_limit():
  start = time.monotonic()
  verdict = sandbox.run_program("while True:\n  pass\n", timeout_s=1.0)
  assert (verdict.passed, verdict.status) == (False, "timeout")
  assert 1.0 <= verdict.seconds and time.monotonic() - start < 5.0


def test_a_fork_bomb_is_limited_and_killed_with_its_group(monkeypatch):
  """Forks stop at the process limit; the survivors spin until the time limit kills the whole
  group."""
  started = []
  popen = sandbox.subprocess.Popen
  monkeypatch.setattr(sandbox.subprocess, "Popen",
                      lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
  start = time.monotonic()
  verdict = sandbox.run_program("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n"
                                "    pass\n", timeout_s=1.5)
  assert (verdict.passed, verdict.status) == (False, "timeout")
  assert time.monotonic() - start < 8.0
  assert gone(started[0].pid)


def test_children_left_behind_by_a_passing_program_are_killed(monkeypatch):
  started = []
  popen = sandbox.subprocess.Popen
  monkeypatch.setattr(sandbox.subprocess, "Popen",
                      lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
  verdict = sandbox.run_program("import os, time\nif os.fork() == 0:\n  time.sleep(60)\n",
                                timeout_s=5.0)
  assert verdict.status == "passed" and verdict.seconds < 4.0
  assert gone(started[0].pid)


def test_pass_at_k_by_hand_and_against_the_combinatorial_formula():
  # 5 samples, 2 pass: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10
  assert metrics.pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-12)
  assert metrics.pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
  assert metrics.pass_at_k(5, 0, 3) == 0.0 and metrics.pass_at_k(5, 3, 3) == 1.0
  for n in range(1, 30):
    for c in range(n + 1):
      for k in range(1, n + 1):
        naive = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert metrics.pass_at_k(n, c, k) == pytest.approx(naive, abs=1e-12), (n, c, k)
  # n = 200 (HumanEval's): the binomials are ~1e59, the product form is exact to float precision
  assert metrics.pass_at_k(200, 37, 100) == pytest.approx(
      1 - math.comb(163, 100) / math.comb(200, 100), rel=1e-12)
  with pytest.raises(ValueError):
    metrics.pass_at_k(3, 1, 4)
