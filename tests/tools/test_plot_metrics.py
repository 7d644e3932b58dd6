"""tools/plot_metrics.py: the PNG, its lines equal to the logged metrics, one-line errors with status 2."""

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import jaxtrain
from jaxtrain.metrics import read_metrics
from tests.fixtures import ROOT
from tests.tools.workdirs import A_ROWS, write_a_b, write_run
from tools import compare_runs
from tools.plot_metrics import main, plot

TITLES = ["training loss", "eval loss", "tokens/s (rows without compilation or eval)",
          "MFU (rows without compilation or eval)"]


def lines(ax) -> list[tuple]:
  """(label, x, y) of each line of a panel, in drawing order."""
  return [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()]


def png_size(path: str) -> tuple[int, int]:
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
  return struct.unpack(">II", head[16:24])


def test_lines_equal_the_metrics(tmp_path):
  out = str(tmp_path / "plot.png")
  fig = plot(write_a_b(str(tmp_path)), out)
  loss, evals, tokens, mfu = fig.axes
  assert [ax.get_title() for ax in fig.axes] == TITLES
  # newest row per step (step 4 logged again after the resume), the torn line and checkpoint events skipped
  assert lines(loss) == [("a", [1, 2, 3, 4, 5, 6], [5.0, 4.0, 3.5, 3.3, 3.0, 2.8]),
                         ("b", [1, 2, 3, 4, 5], [6.0, 5.0, 4.5, 4.0, 3.75]), ("a floor", [0, 1], [2.0, 2.0])]
  assert lines(evals) == [("a", [2, 6], [4.6, 3.1]), ("b", [2, 4], [3.9, 4.2]), ("a floor", [0, 1], [2.5, 2.5])]
  # throughput: not the first row after a start or a restore (compilation), nor a row with an evaluation
  assert lines(tokens) == [("a", [3, 4, 5], [1000.0, 1200.0, 1100.0]), ("b", [3, 5], [800.0, 600.0])]
  assert lines(mfu) == [("a", [3, 4, 5], [0.10, 0.12, 0.11]), ("b", [3, 5], [0.08, 0.06])]
  assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a", "b", "a floor"]
  assert loss.get_lines()[2].get_color() == loss.get_lines()[0].get_color()  # a's floor in a's colour
  assert png_size(out) == (1200, 800)
  with Image.open(out) as image:
    image.verify()
  with Image.open(out) as image:  # drawn on: not a blank canvas
    assert len(np.unique(np.asarray(image.convert("L")))) > 10


def test_a_shared_floor_is_one_grey_line(tmp_path):
  a, b = write_a_b(str(tmp_path))
  a2 = write_run(str(tmp_path), "a2", A_ROWS)
  a3 = write_run(str(tmp_path), "a3", [dict(r, entropy_floor=1.5) for r in A_ROWS if "event" not in r])
  loss = plot([a, b, a2, a3]).axes[0]
  assert [ln.get_label() for ln in loss.lines[:4]] == ["a", "b", "a2", "a3"]
  floors = [(ln.get_label(), ln.get_ydata()[0], ln.get_color()) for ln in loss.lines[4:]]
  assert floors == [("floor of a, a2", 2.0, "grey"), ("a3 floor", 1.5, loss.lines[3].get_color())]
  floors = [(ln.get_label(), ln.get_ydata()[0], ln.get_color()) for ln in plot([a, a2]).axes[0].lines[2:]]
  assert floors == [("floor of all runs", 2.0, "grey")]


def test_runs_named_by_path_when_directories_share_a_name(tmp_path):
  first = write_run(str(tmp_path / "x"), "run", A_ROWS)
  second = write_run(str(tmp_path / "y"), "run", A_ROWS)
  labels = [ln.get_label() for ln in plot([first, second]).axes[2].get_lines()]
  assert labels == [first, second]


def test_a_panel_without_data_says_so(tmp_path):
  workdir = write_run(str(tmp_path), "no_eval", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}])
  evals = plot([workdir]).axes[1]
  assert not evals.get_lines() and [t.get_text() for t in evals.texts] == ["no run logged eval_loss"]


def test_script_writes_the_png(tmp_path):
  out = str(tmp_path / "plot.png")
  cmd = [sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), *write_a_b(str(tmp_path)), "--out", out]
  result = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
  assert (result.returncode, result.stdout) == (0, f"wrote {out}\n"), result.stderr
  assert png_size(out) == (1200, 800)


BAD = {
    "missing workdir": (["{tmp}/nope"], "plot_metrics.py: {tmp}/nope: no such directory"),
    "no metrics.jsonl": (["{tmp}"], "plot_metrics.py: {tmp}: no metrics.jsonl; is it a training workdir?"),
    "no logged steps": (["{tmp}/events"], "plot_metrics.py: {tmp}/events: metrics.jsonl has no logged steps"),
    "not a png": (["{tmp}/a", "--out", "{tmp}/plot.pdf"],
                  "plot_metrics.py: --out {tmp}/plot.pdf: expected a .png path"),
    "no --out": (["{tmp}/a"], "plot_metrics.py: the following arguments are required: --out"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, name):
  write_run(str(tmp_path), "a", A_ROWS)
  write_run(str(tmp_path), "events", [{"step": 3, "event": "checkpoint_save"}], torn='{"step": 4, "lo')
  argv, message = BAD[name]
  argv = [a.format(tmp=tmp_path) for a in argv]
  if "--out" not in argv and name != "no --out":
    argv += ["--out", str(tmp_path / "plot.png")]
  with pytest.raises(SystemExit) as exit_:
    main(argv)
  assert exit_.value.code == 2
  assert capsys.readouterr().err == message.format(tmp=tmp_path) + "\n"
  assert not os.path.exists(tmp_path / "plot.png")


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_a_trained_run(tmp_path, cfg):
  """The real loop's metrics.jsonl: the plotted losses and floors, and compare's final row, are its values."""
  cfg.train.update(steps=3, eval_every=2)
  workdir = str(tmp_path / "tiny")
  jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  rows = [r for r in read_metrics(workdir) if "event" not in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  loss, evals, _, _ = plot([workdir]).axes
  floor = rows[0]["entropy_floor"]
  assert lines(loss) == [("tiny", [1, 2, 3], [r["loss"] for r in rows]), ("tiny floor", [0, 1], [floor, floor])]
  assert lines(evals)[0] == ("tiny", [2, 3], [rows[1]["eval_loss"], rows[2]["eval_loss"]])
  header, table = compare_runs.compare([workdir], ["step", "loss", "loss_gap"])
  assert table == [["tiny", "3", f"{rows[2]['loss']:.4f}", f"{rows[2]['loss'] - floor:.4f}"]]
