"""Disk faults while saving: one line and one row per failed save, training goes on, the last good step restores.

Two real, deterministic faults (chmod does not stop root, and a tiny tmpfs needs mount rights):
  "directory": the tier's parent directory is replaced by a regular file, so creating the step directory fails
               with ENOTDIR from the file system, in the synchronous part of the save;
  "commit":    Orbax's PyTree handler returns, beside its real write futures, one that fails with ENOSPC, so the
               commit fails on Orbax's background thread, as a full disk does.
"""

import concurrent.futures
import errno
import logging
import os
import re
import time
import types

import jax
import orbax.checkpoint as ocp
import pytest

import jaxtrain
from jaxtrain import checkpoint, errors, metrics
from jaxtrain.checkpoint import quiet
from tests.checkpoint.test_manager import final_params, stderr_logging
from tests.fixtures import tiny_config

REASONS = {"directory": "Not a directory", "commit": "No space left on device"}


class Disk:
  """The tier directory `root/disk/ckpt`; `fail(True)` makes saves fail by `kind`, `fail(False)` repairs it."""

  def __init__(self, root, kind: str, monkeypatch):
    self.root, self.kind, self.failing = str(root), kind, False
    self.directory = os.path.join(self.root, "disk", "ckpt")
    if kind == "commit":
      real = ocp.PyTreeCheckpointHandler.async_save

      async def async_save(handler, *args, **kwargs):
        futures = list(await real(handler, *args, **kwargs) or [])
        if self.failing:
          full = concurrent.futures.Future()
          full.set_exception(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
          futures.append(full)
        return futures
      monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", async_save)

  def fail(self, failing: bool):
    disk, away = os.path.join(self.root, "disk"), os.path.join(self.root, "disk.away")
    if self.kind == "directory" and failing and not self.failing:
      os.rename(disk, away)
      open(disk, "w").close()
    elif self.kind == "directory" and self.failing and not failing:
      os.remove(disk)
      os.rename(away, disk)
    self.failing = failing


def train_with_faults(tmp_path, monkeypatch, kind: str, failing, steps: int, **k):
  """Trains tiny_config (a save every 2 steps) with the saves of steps where `failing(step)` failing by `kind`.
  Returns (workdir, {step: params passed to save}, the RunError train raised or None); the disk is repaired."""
  disk = Disk(tmp_path, kind, monkeypatch)
  saved, real = {}, checkpoint.Checkpoints.save

  def save(ckpts, step, state, *args, **kwargs):
    ckpts.wait()  # the previous save is complete before its disk changes under it
    disk.fail(failing(step))
    saved[step] = jax.device_get(state.params)
    return real(ckpts, step, state, *args, **kwargs)
  monkeypatch.setattr(checkpoint.Checkpoints, "save", save)
  cfg = tiny_config(train=dict(steps=steps, eval_every=0), checkpoint=dict(every_steps=2, dir=disk.directory, **k))
  workdir, raised = str(tmp_path / "run"), None
  try:
    with stderr_logging():
      jaxtrain.train(cfg, workdir, devices=jax.devices()[:1], progress=False, sync_every_step=True)
  except errors.RunError as e:
    raised = e
  disk.fail(False)
  return workdir, saved, raised


def events(workdir, event: str) -> list[dict]:
  return [r for r in metrics.read_metrics(workdir) if r.get("event") == event]


def assert_restores(workdir, step: int, saved: dict):
  """The newest complete step is `step`, and it restores to exactly the params that were saved."""
  got_step, params = final_params(workdir)
  assert got_step == step
  jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("restored params differ"), params, saved[step])


def assert_failure_lines(err: str, steps: list[int], kind: str):
  """stderr holds one line per failed save and nothing else (no traceback, no log record of Orbax's)."""
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == len(steps), err[-3000:]
  for line, step in zip(lines, steps):
    assert re.fullmatch(rf"checkpoint save failed at step {step} \(persistent\): .*{REASONS[kind]}.*", line), line


# A directory fault (blocking part) also fails the final save below and, without a training, the last test.
@pytest.mark.parametrize("kind", [pytest.param("directory", marks=pytest.mark.slow), "commit"])
def test_a_save_that_fails_once_is_one_line_and_one_row_and_the_next_save_retries(tmp_path, monkeypatch, capfd, kind):
  start = time.monotonic()
  workdir, saved, raised = train_with_faults(tmp_path, monkeypatch, kind, lambda step: step == 4, steps=6)
  assert raised is None and time.monotonic() - start < 200  # no barrier timeout (300 s)
  assert_failure_lines(capfd.readouterr().err, [4], kind)
  rows = events(workdir, "checkpoint_error")
  assert [(r["step"], r["tier"]) for r in rows] == [(4, "persistent")] and REASONS[kind] in rows[0]["error"]
  assert [r["step"] for r in events(workdir, "checkpoint_save")] == [2, 6]
  assert sorted(os.listdir(os.path.join(tmp_path, "disk", "ckpt"))) == ["2", "6"]  # no half-written step left
  assert_restores(workdir, 6, saved)


@pytest.mark.parametrize("kind", ["commit"])
def test_saves_that_keep_failing_end_the_run_with_save_failed_after_max_failed_saves(tmp_path, monkeypatch, capfd,
                                                                                      kind):
  workdir, saved, raised = train_with_faults(tmp_path, monkeypatch, kind, lambda step: step >= 4, steps=12,
                                             max_failed_saves=3)
  assert isinstance(raised, errors.SaveFailed) and raised.exit_status == 5
  assert re.fullmatch(rf"checkpoint saves to the persistent tier failed 3 times in a row; the last, at step 8: "
                      rf".*{REASONS[kind]}.*", str(raised)), str(raised)
  assert_failure_lines(capfd.readouterr().err, [4, 6, 8], kind)
  assert [r["step"] for r in events(workdir, "checkpoint_error")] == [4, 6, 8]
  assert_restores(workdir, 2, saved)


@pytest.mark.parametrize("kind", ["directory"])
def test_a_failed_final_save_ends_the_run_with_save_failed(tmp_path, monkeypatch, capfd, kind):
  workdir, saved, raised = train_with_faults(tmp_path, monkeypatch, kind, lambda step: step == 6, steps=6)
  assert isinstance(raised, errors.SaveFailed)
  assert re.fullmatch(rf"the final checkpoint save at step 6 failed \(persistent\): .*{REASONS[kind]}.*",
                      str(raised)), str(raised)
  assert_failure_lines(capfd.readouterr().err, [6], kind)
  assert [(r["step"], r["tier"]) for r in events(workdir, "checkpoint_error")] == [(6, "persistent")]
  assert_restores(workdir, 4, saved)


@pytest.mark.parametrize("policy", [dict(every_seconds=0.001), dict(adaptive=True, adaptive_min_steps=1,
                                                                    adaptive_max_steps=1)])
def test_timed_and_adaptive_saves_go_on_after_a_save_failed_in_its_blocking_part(tmp_path, monkeypatch, capfd, policy):
  """Orbax's saving-in-progress flag stays set after such a failure; these policies must not read it."""
  disk = Disk(tmp_path, "directory", monkeypatch)
  ckpts = checkpoint.Checkpoints(tiny_config(checkpoint=dict(dir=disk.directory, **policy)).checkpoint,
                                 str(tmp_path / "run"))
  tree = {"w": jax.numpy.arange(4.0)}
  for step in (1, 2, 3):  # step 1 also lets Orbax finish its start-up cleanup, which a fault would poison
    disk.fail(step == 2)
    time.sleep(0.01)  # every_seconds=0.001 has passed since the last save, or failed save
    assert ckpts.due(step)
    ckpts.save(step, tree, {}, {})
    ckpts.wait()
  disk.fail(False)
  assert [(r.step, r.error and REASONS["directory"] in r.error) for r in ckpts.finished_saves()] == [
      (1, None), (2, True), (3, None)]
  assert sorted(ckpts.tiers[0].manager.all_steps()) == [1, 3]
  ckpts.close()
  assert_failure_lines(capfd.readouterr().err, [2], "directory")


def test_an_adaptive_save_that_failed_is_retried_one_interval_later(tmp_path, monkeypatch, capfd):
  disk = Disk(tmp_path, "directory", monkeypatch)
  cfg = tiny_config(checkpoint=dict(dir=disk.directory, adaptive=True, adaptive_min_steps=2, adaptive_max_steps=2))
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, str(tmp_path / "run"))
  for step in range(1, 9):
    disk.fail(step == 4)
    if ckpts.due(step):
      ckpts.save(step, {"w": jax.numpy.arange(4.0)}, {}, {})
      ckpts.wait()
  disk.fail(False)
  assert [(r.step, r.error is None) for r in ckpts.finished_saves()] == [(2, True), (4, False), (6, True), (8, True)]
  ckpts.close()
  assert_failure_lines(capfd.readouterr().err, [4], "directory")


def test_what_orbax_leaves_after_a_failed_save_is_not_printed(tmp_path, capfd):
  """Measured on a full 64 KiB tmpfs: Orbax's other writes outlive the failed commit; asyncio reports their futures
  (never retrieved, no traceback) and TensorStore's callbacks find Orbax's event loop closed (unraisable)."""
  checkpoint.Checkpoints(tiny_config().checkpoint, str(tmp_path), read_only=True).close()  # installs the filters
  full = ValueError('RESOURCE_EXHAUSTED: Error writing "params.embed/0.0" in OCDBT database at local file '
                    '"/ckpt/4.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": '
                    'No space left on device')
  with stderr_logging():
    logging.getLogger("asyncio").error("Future exception was never retrieved", exc_info=(ValueError, full, None))
    logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=(KeyError, KeyError("x"), None))
  seen, closed = [], RuntimeError("Event loop is closed")
  hook = quiet.unraisable_hook(seen.append)
  for e in (closed, full, KeyError("y")):
    hook(types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=None, err_msg=None, object=None))
  assert [type(u.exc_value) for u in seen] == [KeyError]
  err = capfd.readouterr().err
  assert "No space left" not in err and "ERROR:asyncio:Task exception was never retrieved" in err  # others stay
