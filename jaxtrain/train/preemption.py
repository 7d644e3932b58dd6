"""SIGTERM/SIGINT (preemption, Ctrl-C) become a request to save and stop at the next step boundary.

One process: a Python signal handler sets the flag. Several processes (jax.distributed): every
process must stop at the same step, or the save's collectives hang. jax's preemption sync manager
(started by jax.distributed.initialize) receives SIGTERM on whichever process gets it, spreads the
notice through the coordination service and names one step at which `reached_preemption_sync_point`
is true on all processes; `check(step)` asks it every step (no device collective, no host sync)."""

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
    import jax
    self._multiprocess = jax.process_count() > 1

  def check(self, step: int) -> bool:
    """True at the step where this run must save and stop (the same step on every process)."""
    if self._multiprocess and self.requested is None:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.requested = "SIGTERM"
    return self.requested is not None

  def _handle(self, signum, frame):
    del frame
    self.requested = signal.Signals(signum).name
    self._restore()

  def _restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def __enter__(self):
    # several processes: jax's own SIGTERM notifier must keep the signal (a Python handler would
    # take it)
    if threading.current_thread() is threading.main_thread() and not self._multiprocess:
      self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
    return self

  def __exit__(self, *exc):
    self._restore()
    return False
