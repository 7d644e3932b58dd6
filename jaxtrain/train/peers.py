"""The processes of a multi-process run (jax.distributed): agreement, and the end of a run that lost
one.

`agree(name, value)`: process 0's value on every process, through jax's distributed key-value store;
`gather(name, value)`: every process's value on every process, the same way.

`watch(timeout_s)`: a lost peer ends every survivor with one line naming it and exit status 6
(`errors.PeerLost`) within about 1.2 x `timeout_s` (`train.peer_timeout_s`). jax alone ends it
badly: the survivors' collectives fail or block, and a heartbeat timeout later jax's client aborts
them (status 134, a C++ stack); when process 0 dies, which hosts jax's coordination service, the
others abort at once. So a thread writes this process's heartbeat into the key-value store every
`timeout_s / 10` and reads everyone's: a peer silent for `timeout_s` is lost. An abort by jax's
client (SIGABRT) while watching is named too: the coordinator when it cannot be reached, else the
peer silent longest. Both print the line and `os._exit(6)`: the main thread may be blocked in a
collective that never returns, and a normal exit would wait in jax's shutdown barrier and then
abort.
"""

import contextlib
import ctypes
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time

from jaxtrain import config as config_lib
from jaxtrain.errors import PeerLost, RunError

DONE = "done"  # a peer's last heartbeat when it left `watch` normally: not lost
AGREE_TIMEOUT_MS = 3600 * 1000  # waiting for process 0; a lost one ends the run sooner (watch)
# name -> counter: every process calls agree() with the same names in the same order
_AGREEMENTS = {}
_WATCHES = itertools.count()


def _client():
  # the key-value store that orbax and jax's own multihost code use
  from jax._src import distributed
  return distributed.global_state.client


def agree(name: str, value: str) -> str:
  """Process 0's `value` on every process (a string); one process: `value`."""
  import jax
  if jax.process_count() == 1:
    return value
  key = f"jaxtrain/agree/{name}/{next(_AGREEMENTS.setdefault(name, itertools.count()))}"
  if jax.process_index() == 0:
    _client().key_value_set(key, json.dumps(value))
    return value
  return json.loads(_client().blocking_key_value_get(key, AGREE_TIMEOUT_MS))


def gather(name: str, value: str) -> list[str]:
  """Every process's `value` (a string each), in process order; one process: [value]. Every process
  calls it with the same names in the same order."""
  import jax
  if jax.process_count() == 1:
    return [value]
  key = f"jaxtrain/gather/{name}/{next(_AGREEMENTS.setdefault('gather/' + name, itertools.count()))}"
  _client().key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
  return [json.loads(_client().blocking_key_value_get(f"{key}/{i}", AGREE_TIMEOUT_MS))
          for i in range(jax.process_count())]


class Silence:
  """Each peer's silence: the seconds since the heartbeat it writes last changed, from periodic
  reads.

  A read adds at most two intervals: a watcher that was itself paused blames no peer for its own
  pause."""

  def __init__(self, me: int, interval_s: float):
    self.me, self.interval_s = me, interval_s
    self.beats, self.seconds, self.done = {}, {}, set()
    self._read_at = None

  def read(self, beats: dict[int, str], now: float):
    step = 0.0 if self._read_at is None else min(now - self._read_at, 2 * self.interval_s)
    self._read_at = now
    for peer, beat in beats.items():
      if peer == self.me or peer in self.done:
        continue
      if beat == DONE:
        self.done.add(peer)
      elif beat != self.beats.get(peer):
        self.beats[peer], self.seconds[peer] = beat, 0.0
      else:
        self.seconds[peer] += step

  def longest(self) -> tuple[int | None, float]:
    """(the peer silent longest, seconds); peers that left normally or never wrote are not
    judged."""
    seconds, peer = max(((s, p) for p, s in self.seconds.items() if p not in self.done),
                        default=(0.0, None))
    return peer, seconds

  def who(self, peer: int) -> str:
    words = self.beats.get(peer, "").split()
    return f"pid {words[1]} on {words[2]}" if len(words) == 3 else "never heard from"


class Watch:
  """The heartbeat thread and the abort handler of one `watch`."""

  def __init__(self, timeout_s: float, me: int, count: int):
    self.timeout_s, self.interval_s, self.me, self.count = timeout_s, timeout_s / 10, me, count
    self.prefix = f"jaxtrain/peers/{next(_WATCHES)}/"
    self.silence = Silence(me, self.interval_s)
    self.unreachable_s, self._beat, self._last_tick = 0.0, 0, None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxtrain-peers", daemon=True)

  def tick(self, now: float):
    """Writes this process's heartbeat and reads everyone's."""
    self._beat += 1
    step = 0.0 if self._last_tick is None else min(now - self._last_tick, 2 * self.interval_s)
    self._last_tick = now
    try:
      _client().key_value_set(self.prefix + str(self.me),
                              f"{self._beat} {os.getpid()} {socket.gethostname()}",
                              allow_overwrite=True)
      beats = {
          int(key.rsplit("/", 1)[1]): beat
          for key, beat in _client().key_value_dir_get(self.prefix)
      }
      self.unreachable_s = 0.0
    except Exception:  # noqa: BLE001 (the store is gone with process 0, or jax's client is failing)
      beats, self.unreachable_s = {}, self.unreachable_s + step
    self.silence.read(beats, now)

  def verdict(self) -> str | None:
    """The line that ends this process, once a peer is lost."""
    if self.me != 0 and self.unreachable_s >= self.timeout_s:
      return self._lost(
          0, f"the coordinator's key-value store was unreachable for {self.unreachable_s:.0f} s")
    peer, seconds = self.silence.longest()
    if peer is not None and seconds >= self.timeout_s:
      return self._lost(
          peer, f"no heartbeat for {seconds:.0f} s (train.peer_timeout_s={self.timeout_s:g})")
    return None

  def abort_verdict(self) -> str | None:
    """The line for an abort by jax's client (a peer or the coordinator gone), or None: not a lost
    peer."""
    from jax._src import distributed
    address = distributed.global_state.coordinator_address or ""
    if self.me != 0 and not _reachable(address):
      return self._lost(0, f"the coordinator at {address} is unreachable")
    peer, seconds = self.silence.longest()
    unseen = [p for p in range(self.count) if p != self.me and p not in self.silence.beats]
    if peer is not None and seconds >= 2 * self.interval_s:
      return self._lost(
          peer,
          f"no heartbeat for {seconds:.0f} s, and jax's distributed service found a task dead")
    if unseen:
      return self._lost(unseen[0], "jax's distributed service found a task dead")
    return None

  def _lost(self, peer: int, why: str) -> str:
    return f"lost process {peer} of {self.count} ({self.silence.who(peer)}): {why}"

  def _run(self):
    while not self._stop.wait(self.interval_s):
      self.tick(time.monotonic())
      if (line := self.verdict()) is not None:
        end(line)

  def settle(self):
    """After an error in the main thread (a failed collective, say): gives the heartbeats time to
    name a lost peer (that ends the process), and returns once every peer is heard again or the time
    is up."""
    deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
    # A lost peer's last beat was written before the error, but a read in flight when it came may
    # not have seen it: compare against a read that began after the error (the heartbeat thread's
    # next-but-one tick), or that last beat looks like the peer heard again, and the process leaves
    # to hang in jax's shutdown.
    first = self._beat
    while self._beat < first + 2 and time.monotonic() < deadline:
      self._stop.wait(self.interval_s / 2)
    before = dict(self.silence.beats)
    while time.monotonic() < deadline:
      self._stop.wait(self.interval_s / 2)
      beats, done = self.silence.beats, self.silence.done
      if all(p in done or beats.get(p, before.get(p)) != before.get(p) for p in range(self.count)
             if p != self.me):
        return

  def start(self):
    self.tick(time.monotonic())
    self._thread.start()

  def stop(self, leaving_normally: bool):
    self._stop.set()
    self._thread.join()
    if leaving_normally:
      with contextlib.suppress(Exception):
        _client().key_value_set(self.prefix + str(self.me), DONE, allow_overwrite=True)


def end(line: str):
  """Prints `error: line` as the last line on stderr (on a line of its own) and ends the process
  with PeerLost's status."""
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  # a progress bar may hold the line
  os.write(2, f"\nerror: {PeerLost(line)}\n".encode(errors="replace"))
  os._exit(PeerLost.exit_status)


def _reachable(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=2).close()
  except (OSError, ValueError):
    return False
  return True


# ---- jax's client aborts the process (SIGABRT) when the coordination service reports a dead
# task or cannot be reached; a C-level handler (a Python one would run too late) names the lost
# peer first. ----

_SIGNAL_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_watching: list[Watch] = []


def _on_abort(signum):
  del signum
  line = _watching[-1].abort_verdict() if _watching else None
  if line is not None:
    end(line)
  # else return: abort() restores the default action and ends the process as it meant to


_ON_ABORT = _SIGNAL_HANDLER(_on_abort)  # kept alive for as long as the module


def _set_abort_handler(handler):
  """Installs `handler` (a C function pointer, or None for the default) for SIGABRT; returns the
  previous one."""
  libc = ctypes.CDLL(None)
  libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
  return libc.signal(signal.SIGABRT, handler)


@contextlib.contextmanager
def watch(timeout_s: float):
  """Multi-process runs: a lost peer ends this process with one line and status 6 (see the module
  doc)."""
  import jax
  if jax.process_count() == 1 or _client() is None:
    yield
    return
  w = Watch(timeout_s, jax.process_index(), jax.process_count())
  w.start()
  _watching.append(w)
  previous = _set_abort_handler(ctypes.cast(_ON_ABORT, ctypes.c_void_p))
  leaving_normally = False
  try:
    yield
    leaving_normally = True
  except (config_lib.ConfigError, RunError):
    raise  # our own one-line endings: no peer to wait for
  except Exception:
    w.settle()  # a lost peer ends the process in here
    raise
  finally:
    _set_abort_handler(previous)
    _watching.remove(w)
    w.stop(leaving_normally)
