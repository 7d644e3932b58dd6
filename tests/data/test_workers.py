"""prepare's worker processes: results in any order, errors as one line, no worker left behind, no jax."""

import subprocess
import sys

import numpy as np
import pytest

from jaxtrain.config import default_config
from jaxtrain.data import workers
from jaxtrain.data.prepare import rules_of
from jaxtrain.data.sources import DataError, Piece
from tests.fixtures import ROOT

BYTES = {"kind": "byte"}


def task(index, path, out):
  return index, [Piece("text", str(path), 0, 0, 0, 1)], rules_of(default_config().data), str(out)


@pytest.fixture
def started(monkeypatch):
  """The worker processes that workers.run starts."""
  procs, start = [], workers._start
  monkeypatch.setattr(workers, "_start", lambda: procs.append(start()) or procs[-1])
  return procs


def test_workers_tokenize_every_task_and_exit(tmp_path, started):
  for i in range(5):
    (tmp_path / f"{i}.txt").write_text(f"doc {i}")
  tasks = [task(i, tmp_path / f"{i}.txt", tmp_path / f"{i}.npz") for i in range(5)]
  done = dict(workers.run(BYTES, tasks, 2))
  assert sorted(done) == list(range(5)) and all(c["kept"] == 1 for c in done.values())
  with np.load(tmp_path / "3.npz") as z:
    assert z["tokens"].tolist() == [256, *b"doc 3", 257]
  assert [p.returncode for p in started] == [0, 0]  # ended at the end of their input, and reaped


@pytest.mark.parametrize("spec, error, fragment", [(BYTES, DataError, "cannot read {}/gone.txt"),
                                                   ({"kind": "nope"}, ValueError, "unknown kind 'nope'")])
def test_a_worker_error_is_one_line_here_and_stops_the_others(tmp_path, spec, error, fragment, started):
  (tmp_path / "ok.txt").write_text("fine")
  tasks = [task(0, tmp_path / "ok.txt", tmp_path / "0.npz"), task(1, tmp_path / "gone.txt", tmp_path / "1.npz")]
  with pytest.raises(error) as e:
    list(workers.run(spec, tasks, 2))
  assert fragment.format(tmp_path) in str(e.value) and "\n" not in str(e.value), str(e.value)
  assert len(started) == 2 and all(p.returncode is not None for p in started)  # killed or ended, and reaped


def test_a_worker_imports_neither_jax_nor_the_script_that_started_it():
  boot = workers._BOOT.format(root=ROOT).replace("serve(out)", "print(sorted({'jax', 'grain', '__mp_main__'} & "
                                                              "set(sys.modules)))")
  run = subprocess.run([sys.executable, "-c", boot], capture_output=True, text=True, timeout=60)
  assert run.returncode == 0 and run.stderr.strip().splitlines()[-1] == "[]", run.stderr[-2000:]
