"""Fast restarts: JAX's persistent compilation cache kept per workdir, and the `restart` row that
says where a resumed run's time went from the process's start to its first step.

`train.compilation_cache`: "workdir" (default) keeps compiled programs in WORKDIR/jax_cache, unless
the caller already chose a directory (JAX_COMPILATION_CACHE_DIR, `jax.config`), which is kept; a path
keeps them there; "" leaves jax's own setting alone. A restart then loads the train step instead of
compiling it: the cache key is the program, its devices and compile options, and nothing of the run
(tests/train/test_restart.py checks that a second process compiles nothing).

The `restart` row (an event row in metrics.jsonl, written by a resumed run after its first step):
`restart_<part>_s` for the parts of `PARTS`, consecutive intervals that add up to `restart_total_s`,
measured from the process's creation, and the persistent cache's hits and misses. `imports` is
everything before `train()` is called: for the CLI the interpreter, flags, config and imports; in a
notebook that resumes a run, the whole session before the call.
"""

import os
import time

import jax

PARTS = ("imports", "backend", "setup", "restore", "compile", "first_step")
# programs that compile faster than this are not worth a file (the train step takes seconds)
MIN_COMPILE_TIME_S = 0.2
_events = {"hits": 0, "requests": 0}
_listening = False


def process_start() -> float:
  """Wall-clock time (time.time()) at which this process was created. On Linux from its start in
  clock ticks since boot against /proc/uptime (psutil's boot time is whole seconds: up to 1 s
  early)."""
  try:
    with open("/proc/self/stat") as f, open("/proc/uptime") as g:
      ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
      uptime = float(g.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    import psutil
    return psutil.Process().create_time()


def use_compilation_cache(setting: str, workdir: str) -> str | None:
  """Points jax's persistent compilation cache at the directory `setting` names (see the module
  docstring); returns the directory in use, or None."""
  _listen()
  current = jax.config.jax_compilation_cache_dir
  if setting == "":
    return current
  if setting == "workdir":
    if current:
      return current
    path = os.path.join(os.path.abspath(workdir), "jax_cache")
  else:
    path = os.path.abspath(os.path.expanduser(setting))
  if path != current:
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    compilation_cache.reset_cache()  # an earlier directory, or none, stays no longer
  return path


def _listen():
  """Counts the persistent cache's lookups and hits in this process (jax.monitoring events)."""
  global _listening
  if _listening:
    return

  def count(event: str, **_):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
      _events["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
      _events["hits"] += 1

  jax.monitoring.register_event_listener(count)
  _listening = True


class Startup:
  """The intervals from the process's creation to the first step, charged part by part (`charge`);
  `row()` is the `restart` event row."""

  def __init__(self, clock=time.time):
    self.clock = clock
    self.mark = process_start()
    self.seconds = dict.fromkeys(PARTS, 0.0)
    self.charge("imports")  # interpreter, CLI, config and imports: everything before train()
    self.cache_before = dict(_events)
    self.cache_dir = None

  def charge(self, part: str) -> float:
    now = self.clock()
    seconds, self.mark = now - self.mark, now
    self.seconds[part] += seconds
    return seconds

  def row(self) -> dict:
    out = {"event": "restart", **{f"restart_{k}_s": v for k, v in self.seconds.items()},
           "restart_total_s": sum(self.seconds.values())}
    hits = _events["hits"] - self.cache_before["hits"]
    out["restart_cache_hits"] = hits
    out["restart_cache_misses"] = _events["requests"] - self.cache_before["requests"] - hits
    out["compilation_cache"] = self.cache_dir or ""
    return out
