"""File trees with symlinks followed into each real directory once, so that link loops end. Stdlib
only.

os.walk(followlinks=True) and glob's `**` re-enter a directory through every link to it: two loops
(`ln -s . d/self; ln -s .. d/sub/back`) make that walk exponential before ELOOP ends it. Here a
directory or file is known by (st_dev, st_ino) and taken at its first path only.
"""

import fnmatch
import glob as glob_lib
import os

GLOB_CHARS = "*?["


def _identity(path: str):
  """(st_dev, st_ino) of what path names after links; the path itself when it cannot be stat'ed."""
  try:
    st = os.stat(path)
  except OSError:
    return path
  return st.st_dev, st.st_ino


def _first(seen: set, path: str) -> bool:
  """True the first time a real file or directory is met (by identity), False after."""
  key = _identity(path)
  if key in seen:
    return False
  seen.add(key)
  return True


def walk(root: str) -> list[str]:
  """Files under root, hidden entries skipped; links are followed into each real directory once
  (at its first path, top-down in sorted order), so symlink loops end."""
  out, seen = [], {_identity(root)}
  for dirpath, dirs, files in os.walk(root, followlinks=True):
    dirs[:] = [d for d in sorted(dirs)
               if not d.startswith(".") and _first(seen, os.path.join(dirpath, d))]
    out += [os.path.join(dirpath, f) for f in sorted(files) if not f.startswith(".")]
  return out


def _match(names: list[str], patterns: list[str]) -> bool:
  """Whether path components match glob components; "**" matches zero or more of them."""
  if not patterns:
    return not names
  if patterns[0] == "**":
    return _match(names, patterns[1:]) or (bool(names) and _match(names[1:], patterns))
  return (bool(names) and fnmatch.fnmatchcase(names[0], patterns[0])
          and _match(names[1:], patterns[1:]))


def glob(spec: str) -> list[str]:
  """The files glob.glob(spec, recursive=True) names, sorted; "**" walks like walk (loops end)."""
  if "**" not in spec:
    return sorted(f for f in glob_lib.glob(spec) if not os.path.isdir(f))
  parts = spec.split(os.sep)
  k = next(i for i, part in enumerate(parts) if any(c in part for c in GLOB_CHARS))
  root = os.sep.join(parts[:k]) or (os.sep if k else "")
  rels = (os.path.relpath(f, root or os.curdir) for f in walk(root or os.curdir))
  return sorted(os.path.join(root, rel) for rel in rels if _match(rel.split(os.sep), parts[k:]))


def once(files: list[str]) -> list[str]:
  """files without a file listed before under another name (a symlink or hard link to it)."""
  seen = set()
  return [f for f in files if _first(seen, f)]
