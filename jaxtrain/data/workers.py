"""prepare's tokenizer workers: child processes fed shard tasks as JSON lines.
Numpy only in the child.

Started with subprocess, not multiprocessing: a multiprocessing "spawn" child re-imports the
parent's __main__, so a script without an `if __name__ == "__main__":` guard ran its jaxtrain.train
call again in every worker, and the pool respawned the failing workers forever; "fork" after jax has
started its threads can deadlock. A child here runs only this module's serve(), with the jaxtrain
packages' __init__ files skipped (they import jax), so it starts quickly and small.
"""

import functools
import json
import os
import selectors
import subprocess
import sys

from jaxtrain.data import shards, sources
from jaxtrain.data.sources import DataError

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Protocol on a copy of stdout; the child's own stdout goes to stderr, so a stray print cannot
# garble it.
_BOOT = ("import os, sys, types\n"
         "out = os.dup(1)\n"
         "os.dup2(2, 1)\n"
         "for name in ('jaxtrain', 'jaxtrain.data'):\n"
         "  sys.modules[name] = types.ModuleType(name)\n"
         "  sys.modules[name].__path__ = [os.path.join({root!r}, *name.split('.'))]\n"
         "from jaxtrain.data.workers import serve\n"
         "serve(out)\n")
ERRORS = {"DataError": DataError, "ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def _start() -> subprocess.Popen:
  """A worker that imports this very jaxtrain (the stub packages' __path__ points at it)."""
  return subprocess.Popen([sys.executable, "-c", _BOOT.format(root=_ROOT), "jaxtrain.data.workers"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _send(proc: subprocess.Popen, task, tokenizer_spec: dict) -> None:
  proc.stdin.write(json.dumps({"task": task, "tokenizer": tokenizer_spec}) + "\n")
  proc.stdin.flush()


def _reply(proc: subprocess.Popen) -> tuple[int, dict]:
  """The (index, counts) a worker wrote, or its error raised here as one line."""
  line = proc.stdout.readline()
  if not line:
    raise DataError(f"a prepare worker exited with status {proc.wait()} (its error is above)")
  reply = json.loads(line)
  if "error" in reply:
    raise ERRORS.get(reply["type"], RuntimeError)(reply["error"])
  return reply["index"], reply["counts"]


def run(tokenizer_spec: dict, tasks: list, workers: int):
  """(index, counts) of each task (index, pieces, rules, path) as it finishes,
  over `workers` children."""
  procs = [_start() for _ in range(min(workers, len(tasks)))]
  todo, finished = list(reversed(tasks)), False
  try:
    with selectors.DefaultSelector() as selector:
      for proc in procs:
        _send(proc, todo.pop(), tokenizer_spec)
        selector.register(proc.stdout, selectors.EVENT_READ, proc)
      busy = len(procs)
      while busy:
        for key, _ in selector.select():
          yield _reply(key.data)  # one task per worker in flight: one line at most to read
          if todo:
            _send(key.data, todo.pop(), tokenizer_spec)
          else:
            selector.unregister(key.fileobj)
            busy -= 1
    finished = True
  finally:
    for proc in procs:
      _stop(proc, finished)


def _stop(proc: subprocess.Popen, idle: bool) -> None:
  """Ends a worker: EOF on its input when it is idle (it exits), a kill when it may be at work."""
  if not idle:
    proc.kill()
  try:
    proc.stdin.close()
  except OSError:  # a broken pipe: it is gone already
    pass
  proc.wait()
  proc.stdout.close()


@functools.lru_cache(maxsize=1)
def _tokenizer(spec: str):
  from jaxtrain.data.tokenizers import load_tokenizer
  return load_tokenizer(json.loads(spec))


def _do(message: dict) -> dict:
  index, pieces, rules, path = message["task"]
  tokenizer = _tokenizer(json.dumps(message["tokenizer"], sort_keys=True))
  pieces = [sources.Piece(*p) for p in pieces]
  _, counts = shards.run_shard(tokenizer, index, pieces, shards.Rules(*rules), path)
  return {"index": index, "counts": counts}


def serve(out: int) -> None:
  """The child: one task (with the tokenizer spec) per JSON line on stdin,
  one reply line each on `out`."""
  with os.fdopen(out, "w") as replies:
    for line in sys.stdin:
      try:
        reply = _do(json.loads(line))
      except Exception as e:  # noqa: BLE001 (raised again in the parent, as one line)
        reply = {"error": (str(e).splitlines() or [type(e).__name__])[0], "type": type(e).__name__}
      replies.write(json.dumps(reply) + "\n")
      replies.flush()
