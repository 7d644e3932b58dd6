"""Running generated code against its unit tests in a subprocess: `run_program(source) -> Verdict`.

What is isolated: the program runs as `python -I` (no PYTHON* variables, no user site, the script's
directory not on sys.path) with an empty environment, in a fresh temporary directory (its working
directory, deleted after), in a process group of its own that is killed whole (SIGKILL) when the
wall-time limit passes and after every run (a test that hangs, forks or leaves children behind never
outlives it). Before the program's first line a prelude sets hard limits (address space, processes,
file size, no core files), and replaces socket.socket, socket.create_connection,
socket.getaddrinfo and socket.socketpair with functions that raise (no network from the standard
library). Run as root, the prelude drops to the `nobody` user (uid/gid 65534) first, so the process
limit counts only the sandbox's own processes (root ignores RLIMIT_NPROC).

What is not isolated: the filesystem (the program can read what its user can read), the `_socket`
C module and ctypes (code set on reaching the network can), CPU beyond the wall time, and processes
that call setsid() to leave the group. Untrusted code at scale belongs in a container or VM with no
network namespace; this is the harness's line of defence against mistakes, not against attacks.

The limits are set inside the child (by the prelude) rather than in a preexec_fn: preexec_fn is not
safe in a parent with threads, and jax's runtime has many.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

NOBODY = 65534

PRELUDE = """\
import os, resource, socket, sys
if os.getuid() == 0:
  os.setgroups([]); os.setgid({nobody}); os.setuid({nobody})
for limit, value in ((resource.RLIMIT_AS, {memory}), (resource.RLIMIT_NPROC, {processes}),
                     (resource.RLIMIT_FSIZE, {file_bytes}), (resource.RLIMIT_CORE, 0)):
  resource.setrlimit(limit, (value, value))
def _no_network(*args, **kwargs):
  raise OSError("network access is disabled in the evaluation sandbox")
socket.socket = socket.create_connection = socket.getaddrinfo = socket.socketpair = _no_network
del os, resource, socket, sys, limit, value
with open("program.py", encoding="utf-8") as _f:
  _code = compile(_f.read(), "program.py", "exec")
exec(_code, {{"__name__": "__main__"}})
"""


class Verdict(NamedTuple):
  """passed: exit status 0 within the time; status: "passed", "failed" or "timeout"; the last lines
  of the program's stderr (why it failed); seconds of wall time."""
  passed: bool
  status: str
  stderr: str
  seconds: float


def _kill_group(pgid: int, wait_s: float = 2.0) -> None:
  """SIGKILL to the group, then up to wait_s for it to be gone (its processes count against the
  process limit of the next run)."""
  deadline = time.monotonic() + wait_s
  try:
    os.killpg(pgid, signal.SIGKILL)
    while time.monotonic() < deadline:
      os.killpg(pgid, 0)
      time.sleep(0.01)
  except (ProcessLookupError, PermissionError):  # nothing left in the group
    pass


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512, processes: int = 32,
                file_mb: int = 16) -> Verdict:
  """Runs `source` (a completion and its tests) in the sandbox; passed when it exits with status 0
  within timeout_s. A run that passes the time is killed with its process group: "timeout"."""
  workdir = tempfile.mkdtemp(prefix="jaxtrain-sandbox-")
  try:
    os.chmod(workdir, 0o777)  # writable by `nobody` after the drop
    with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
      f.write(source)
    prelude = PRELUDE.format(nobody=NOBODY, memory=memory_mb << 20, processes=processes,
                             file_bytes=file_mb << 20)
    with open(os.path.join(workdir, "stderr"), "w+b") as err:
      start = time.monotonic()
      proc = subprocess.Popen([sys.executable, "-I", "-c", prelude], cwd=workdir, env={},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                              start_new_session=True)
      try:
        code = proc.wait(timeout=timeout_s)
        status = "passed" if code == 0 else "failed"
      except subprocess.TimeoutExpired:
        _kill_group(proc.pid, wait_s=0.0)
        proc.wait()  # reaped: the group's leader is no longer there for _kill_group to wait on
        status = "timeout"
      _kill_group(proc.pid)  # children the program left behind
      seconds = time.monotonic() - start
      err.seek(0)
      tail = err.read()[-2000:].decode("utf-8", "replace")
    return Verdict(status == "passed", status, tail, seconds)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
