"""One training run per workdir: an exclusive flock on WORKDIR/.lock, a file that names its holder
(pid, host).

The OS drops a flock when its holder dies, however it dies, so the lock of a killed run is free and
taken over. A flock that outlived its pid on this host (a forked child inherited it) is stale too:
the file is replaced. Released (the file removed) on every exit of `hold`; multi-process runs:
process 0 holds it for all."""

import contextlib
import fcntl
import os
import socket

from jaxtrain import config as config_lib

NAME = ".lock"


class Lock:
  """Holds `workdir`'s lock from construction to `release()`; a live holder elsewhere is one
  ConfigError line."""

  def __init__(self, workdir: str):
    self.workdir, self.path = workdir, os.path.join(workdir, NAME)
    self._created = not os.path.isdir(workdir)
    try:
      os.makedirs(workdir, exist_ok=True)
      # another process may replace or remove the file between our open and flock
      for _ in range(10):
        self._fd = _locked(self.path)
        if self._fd is not None:
          os.ftruncate(self._fd, 0)
          os.write(self._fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
          return
    except OSError as e:  # not BlockingIOError: _locked turns a held lock into a ConfigError
      raise config_lib.ConfigError(
          f"--workdir {workdir}: cannot lock {self.path}: {e.strerror}") from e
    raise config_lib.ConfigError(
        f"{workdir}: could not take {self.path}; other processes keep replacing it")

  def release(self):
    """Removes the file while still holding it (a waiter that opened it sees that and retries), then
    unlocks."""
    if self._fd is None:
      return
    with contextlib.suppress(FileNotFoundError):
      os.unlink(self.path)
    os.close(self._fd)  # closing the only descriptor releases the flock
    self._fd = None
    if self._created:
      with contextlib.suppress(OSError):
        # only when empty: a run refused before it wrote anything leaves nothing
        os.rmdir(self.workdir)


def _locked(path: str) -> int | None:
  """A descriptor of `path` that holds its flock, or None to try again; ConfigError when a live run
  holds it."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    pid, host, inode = _holder(fd)
    os.close(fd)
    if host != socket.gethostname() or pid is None or _alive(pid):
      raise config_lib.ConfigError(
          f"{os.path.dirname(path)} is in use by another training run (pid {pid or '?'} "
          f"on {host or '?'}); wait for it to end or use another --workdir") from None
    # stale: replace the file (unless someone already did)
    with contextlib.suppress(FileNotFoundError):
      if os.stat(path).st_ino == inode:
        os.unlink(path)
    return None
  try:
    same = os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    same = False
  if not same:  # removed or replaced since we opened it: this flock guards nothing
    os.close(fd)
    return None
  return fd


def _holder(fd: int) -> tuple[int | None, str | None, int]:
  """(pid, host, inode) of a lock file; pid and host are None while the holder has not written them
  yet."""
  words = os.pread(fd, 512, 0).decode(errors="replace").split()
  pid = int(words[0]) if words and words[0].isdigit() else None
  return pid, (words[1] if len(words) > 1 else None), os.fstat(fd).st_ino


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


@contextlib.contextmanager
def hold(workdir: str):
  """The workdir's lock for the duration of a training run; released on every exit, exceptions
  included."""
  import jax
  from jaxtrain.train import peers
  held, refused = None, ""
  if jax.process_index() == 0:
    try:
      held = Lock(workdir)
    except config_lib.ConfigError as e:
      refused = str(e)
  refused = peers.agree("workdir_lock", refused)  # the other processes learn process 0's outcome
  if refused:
    raise config_lib.ConfigError(refused)
  try:
    yield held
  finally:
    if held is not None:
      held.release()
