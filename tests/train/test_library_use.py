"""jaxtrain as a library in one process (a notebook's kernel): many `train` calls without leaking, a
KeyboardInterrupt in a step saves and returns, `read_metrics` as a table and `plot`."""

import ctypes
import ctypes.util
import gc
import os
import sys

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import metrics
from jaxtrain.core.lm import LanguageModel
from tests.fixtures import tiny_config
from tests.tools.workdirs import A_ROWS, B_ROWS, write_run


def losses(workdir) -> dict:
  return {r["step"]: r["loss"] for r in metrics.read_metrics(workdir) if "loss" in r}


def rss_mib() -> float:
  """Resident set size of this process (Linux /proc/self/statm: pages)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_rss_mib() -> float:
  """RSS once glibc has returned its free heap pages (malloc_trim): what is still referenced. Measured: a run
  leaves ~250 MiB of freed pages in glibc's arenas (XLA compiles on its own threads), which the next run
  reuses; trimmed, RSS is flat from the fourth run on."""
  gc.collect()
  ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
  return rss_mib()


class Interrupted(LanguageModel):
  """Language modeling whose host code is interrupted (Ctrl-C outside the signal handler) before step `at`."""

  def __init__(self, cfg, workdir, at: int):
    super().__init__(cfg, workdir)
    self.at = at

  def make_batch(self, params, extra, task_state, batch, step):
    if step == self.at:
      raise KeyboardInterrupt
    return batch


@pytest.mark.slow  # ten compilations: ~1.5 minutes on 2 idle cores
@pytest.mark.long  # 190 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_ten_runs_in_one_process_do_not_grow_memory_and_an_interrupted_one_resumes(tmp_path):
  """Other configs, other meshes (devices=), a KeyboardInterrupt raised in a step's host code (it saves and
  returns) and the resume of that workdir; RSS after the tenth run within 10% of after the second (live
  memory: glibc's retained free pages trimmed first; without jax.clear_caches, which would also drop the
  caller's own compiled functions)."""
  one, devices = jax.devices()[:1], jax.devices()
  base = {"model": dict(n_layers=1)}
  cfg = lambda **sections: tiny_config(**{**base, **sections})  # noqa: E731
  runs = [  # (workdir, config, devices, task or None); the first two do each kind of thing once
      ("a_on_4", cfg(mesh=dict(data=2, fsdp=2)), devices[:4], None),  # run a on a 2 x 2 mesh
      ("stopped", cfg(), one, lambda c, w: Interrupted(c, w, at=2)),  # run a, Ctrl-C before step 3
      ("a", cfg(), one, None),
      ("b", cfg(model=dict(n_layers=2)), one, None),
      ("c", cfg(model=dict(n_layers=1, d_model=64, head_dim=16, d_ff=128)), one, None),
      ("a_on_2", cfg(mesh=dict(data=1, tensor=2, rules="fsdp_tp")), devices[:2], None),
      ("stopped", cfg(), one, None),  # the same call again: resumes the stopped run
      ("d", cfg(train=dict(seq_len=32)), one, None),
      ("e", cfg(optim=dict(lr=3e-3)), one, None),
      ("f", cfg(train=dict(batch_size=4)), one, None),
  ]
  raw, live, results = [], [], []
  for name, config, devs, task in runs:
    workdir = str(tmp_path / name)
    results.append(jaxtrain.train(config, workdir, task=task and task(config, workdir), progress=False, devices=devs))
    raw.append(rss_mib())
    live.append(live_rss_mib())
  print(f"RSS MiB after each run: {[round(r) for r in raw]}; trimmed: {[round(r) for r in live]}", file=sys.stderr)
  assert live[9] <= 1.10 * live[1], live

  # the interrupted run saved the step it stopped at and returned; the same call resumed it exactly
  assert results[1]["preempted"] == "KeyboardInterrupt" and results[1]["step"] == 2
  assert "preempted" not in results[6] and results[6]["step"] == 4
  assert losses(tmp_path / "stopped") == losses(tmp_path / "a")  # the interrupted batch is the resume's first
  saves = [r["step"] for r in metrics.read_metrics(tmp_path / "stopped") if r.get("event") == "checkpoint_save"]
  assert saves[0] == 2
  # another mesh continues the same computation (float reassociation only)
  for other in ("a_on_4", "a_on_2"):
    np.testing.assert_allclose(list(losses(tmp_path / other).values()), list(losses(tmp_path / "a").values()),
                               rtol=1e-5)


def test_read_metrics_is_a_data_frame_or_the_rows(tmp_path):
  pd = pytest.importorskip("pandas")
  workdir = write_run(str(tmp_path), "a", A_ROWS, torn='{"step": 7, "lo')
  frame = jaxtrain.read_metrics(workdir)
  assert isinstance(frame, pd.DataFrame) and list(frame.columns)[0] == "step" and len(frame) == len(A_ROWS)
  steps = frame[frame["event"].isna()]
  assert list(steps["step"]) == [r["step"] for r in A_ROWS if "event" not in r]
  assert list(steps["loss"]) == [r["loss"] for r in A_ROWS if "event" not in r]
  assert list(frame["event"].dropna()) == ["checkpoint_save", "checkpoint_restore"]
  assert jaxtrain.read_metrics(workdir, as_frame=False) == A_ROWS == metrics.read_metrics(workdir)


def test_read_metrics_without_pandas_is_the_list(tmp_path, monkeypatch):
  workdir = write_run(str(tmp_path), "b", B_ROWS)
  monkeypatch.setitem(sys.modules, "pandas", None)  # as if it were not installed
  assert jaxtrain.read_metrics(workdir) == B_ROWS
  with pytest.raises(ImportError):
    jaxtrain.read_metrics(workdir, as_frame=True)


def test_plot_draws_the_logged_values_and_the_floor(tmp_path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  a, b = write_run(str(tmp_path), "a", A_ROWS), write_run(str(tmp_path), "b", B_ROWS)
  fig = jaxtrain.plot(a, keys=("loss", "grad_norm"))
  loss, grad = fig.axes
  # the newest row of a step logged twice (a resume), checkpoint events skipped
  assert [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ln in loss.lines] == [
      ("a", [1, 2, 3, 4, 5, 6], [5.0, 4.0, 3.5, 3.3, 3.0, 2.8]), ("a floor", [0, 1], [2.0, 2.0])]
  assert loss.lines[1].get_linestyle() == "--" and loss.get_title() == "training loss"
  assert list(grad.lines[0].get_ydata()) == [1.5, 1.25, 1.0, 0.8, 0.7, 0.6] and grad.get_title() == "grad_norm"
  plt.close(fig)

  fig, (left, right) = plt.subplots(1, 2)
  assert jaxtrain.plot([a, b], keys=("eval_loss", "mfu"), ax=(left, right)) is fig
  assert [ln.get_label() for ln in left.lines] == ["a", "b", "a floor"]
  assert list(right.lines[1].get_xdata()) == [3, 5]  # throughput without compilation or eval rows
  with pytest.raises(ValueError, match="an Axes per key"):
    jaxtrain.plot(a, keys=("loss", "mfu"), ax=left)
  plt.close(fig)
