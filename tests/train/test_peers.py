"""train/peers.py without a cluster: who is silent, and an abort by jax's client turned into one line and status 6.
Two real processes losing one: tests/train/test_multiprocess.py."""

import os
import subprocess
import sys
import threading
import time

import pytest

from jaxtrain.train import peers
from tests.fixtures import ROOT
from tests.train.test_multiprocess import free_port


def test_silence_counts_only_a_peer_whose_heartbeat_stopped():
  s = peers.Silence(me=0, interval_s=1.0)
  s.read({0: "1 10 a", 1: "1 11 b", 2: "1 12 c"}, now=0.0)
  s.read({0: "2 10 a", 1: "2 11 b", 2: "1 12 c"}, now=1.0)
  s.read({0: "3 10 a", 1: "3 11 b", 2: "1 12 c"}, now=2.0)
  assert s.longest() == (2, 2.0) and s.who(2) == "pid 12 on c" and s.who(3) == "never heard from"
  s.read({1: "3 11 b", 2: "1 12 c"}, now=30.0)  # this watcher was paused 28 s: at most two intervals count
  assert s.seconds == {1: 2.0, 2: 4.0}
  s.read({1: peers.DONE, 2: "2 12 c"}, now=31.0)  # 1 left normally, 2 wrote again
  assert s.longest() == (2, 0.0) and s.done == {1}
  s.read({1: peers.DONE, 2: "2 12 c"}, now=32.0)
  assert s.longest() == (2, 1.0)


class Store:
  """jax's distributed key-value store in memory: the two calls a Watch makes."""

  def __init__(self):
    self.kv = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


@pytest.mark.parametrize("alive", [False, True])
def test_settle_waits_out_a_peer_whose_last_beat_came_after_the_last_read(monkeypatch, alive):
  # The main thread's collective fails as peer 1 dies; peer 1's last beat was written after this process's
  # last read. That beat is no sign of life: settle must wait for the heartbeats' verdict (its deadline here,
  # as no verdict thread runs), not return and let the process hang in jax's shutdown (CI, 2026-12-01).
  store = Store()
  monkeypatch.setattr(peers, "_client", lambda: store)
  w = peers.Watch(2.0, 0, 2)
  store.kv[w.prefix + "1"] = "5 11 b"
  w.tick(time.monotonic())
  store.kv[w.prefix + "1"] = "6 11 b"  # peer 1's last beat
  stop = threading.Event()

  def heartbeats():
    for beat in range(7, 1000):
      if stop.wait(w.interval_s):
        return
      if alive:
        store.kv[w.prefix + "1"] = f"{beat} 11 b"
      w.tick(time.monotonic())

  thread = threading.Thread(target=heartbeats)
  thread.start()
  start = time.monotonic()
  w.settle()
  took = time.monotonic() - start
  stop.set()
  thread.join()
  deadline = w.timeout_s + 3 * w.interval_s
  assert (took < deadline - 0.5) if alive else (took >= deadline), took


ABORT = """import os, sys
from jax._src import distributed
from jaxtrain.train import peers
distributed.global_state.coordinator_address = sys.argv[1]
me, count, silent = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
w = peers.Watch(10.0, me, count)
w.silence.read({p: f"1 {100 + p} host{p}" for p in range(count)}, now=0.0)
w.silence.read({p: f"{1 + (p != silent)} {100 + p} host{p}" for p in range(count)}, now=3.0)  # all but one wrote
peers._watching.append(w)
peers._set_abort_handler(peers.ctypes.cast(peers._ON_ABORT, peers.ctypes.c_void_p))
print("aborting", flush=True)
os.abort()  # as jax's client does (LOG(FATAL)) on a thread of its own when the coordination service fails
"""


def abort_in_subprocess(address: str, me: int, count: int, silent: int) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", ABORT, address, str(me), str(count), str(silent)], capture_output=True,
                        text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), timeout=120)


@pytest.mark.parametrize("me, count, silent, status, line", [
    (1, 2, 1, 6, "error: lost process 0 of 2 (pid 100 on host0): the coordinator at {address} is unreachable"),
    (0, 3, 2, 6, "error: lost process 2 of 3 (pid 102 on host2): no heartbeat for 2 s, and jax's distributed service "
              "found a task dead"),
    (0, 1, 0, -6, "aborting"),  # nobody to blame: the abort goes on as jax meant it
])
def test_an_abort_while_watching_names_the_lost_peer_and_ends_with_status_6(me, count, silent, status, line):
  address = f"localhost:{free_port()}"  # nothing listens there: the coordinator is gone
  p = abort_in_subprocess(address, me, count, silent)
  last = (p.stderr.strip().splitlines() or [""])[-1] if status == 6 else p.stdout.strip()
  assert p.returncode == status and last == line.format(address=address), (p.returncode, p.stderr[-2000:])
