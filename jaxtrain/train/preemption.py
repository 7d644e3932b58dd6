"""SIGTERM/SIGINT (preemption, Ctrl-C) become a request to save and stop at the next step boundary."""

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STATUS = 3  # the CLI's status after a preemption was saved: "rerun the same command to resume"


class Preemption:
  """Context manager: while active, the signals set `requested` instead of killing the process.

  Handlers install only in the main thread (elsewhere, e.g. some notebooks' workers, it is a no-op).
  A second signal restores the previous handlers, so a repeated Ctrl-C still interrupts."""

  def __init__(self):
    self.requested = None  # the signal's name once one arrived
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    self.requested = signal.Signals(signum).name
    self._restore()

  def _restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
    return self

  def __exit__(self, *exc):
    self._restore()
    return False
