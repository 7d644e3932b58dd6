"""Orbax's own reports, quieted: a failed save is one line from Checkpoints (manager.py), not
Orbax's log records, asyncio's reports of its write tasks, or errors raised at exit by tasks that
outlived it."""

import logging
import os
import sys
import traceback


def _from_orbax(e: BaseException | None, tb) -> bool:
  """Raised in Orbax's code, or by TensorStore writing into one of Orbax's temporary step
  directories."""
  return (any(f"{os.sep}orbax{os.sep}" in frame.f_code.co_filename
              for frame, _ in traceback.walk_tb(tb)) or ".orbax-checkpoint-tmp" in str(e))


class _QuietOrbax(logging.Filter):
  """Drops Orbax's log records (INFO chatter, warnings about choices made here such as a read-only
  manager, errors that repeat with tracebacks the exceptions that Checkpoints reports in one line),
  and asyncio's reports of Orbax's write tasks that outlive a failed save. Remove it from the "absl"
  and "asyncio" loggers to see them."""

  def filter(self, record) -> bool:
    if record.name == "asyncio":
      return not (record.exc_info and _from_orbax(*record.exc_info[1:]))
    return f"{os.sep}orbax{os.sep}" not in record.pathname


QUIET_ORBAX = _QuietOrbax()


def unraisable_hook(hook):
  """`hook` (sys.unraisablehook) without the errors of Orbax's write tasks that outlive a failed
  save: TensorStore completing a write for an event loop that Orbax closed, a task collected at
  exit."""
  def quiet(u):
    closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
    task = f"{os.sep}orbax{os.sep}" in getattr(getattr(u.object, "cr_code", None), "co_filename",
                                               "")
    if not (closed or task or _from_orbax(u.exc_value, u.exc_traceback)):
      hook(u)
  quiet.quiet_orbax = True
  return quiet


def install():
  """Installs, once, the filters above:
  our one line per failed save is all the user needs to see."""
  for name in ("absl", "asyncio"):  # Orbax logs through absl's logger
    if QUIET_ORBAX not in logging.getLogger(name).filters:
      logging.getLogger(name).addFilter(QUIET_ORBAX)
  if not getattr(sys.unraisablehook, "quiet_orbax", False):
    sys.unraisablehook = unraisable_hook(sys.unraisablehook)
