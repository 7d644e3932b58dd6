"""Training runs as the tools read them: a workdir's logged rows and config, and one-line CLI errors."""

import argparse
import dataclasses
import json
import os
import sys

from jaxtrain.metrics import read_metrics
from jaxtrain.plotting import series, timed_rows  # noqa: F401  (the tools' too)


class RunError(ValueError):
  """A workdir the tools cannot read; the CLIs print it as one line and exit with status 2."""


@dataclasses.dataclass
class Run:
  name: str
  rows: list[dict]  # every step row of metrics.jsonl in file order (checkpoint events left out)
  timed: list[dict]  # the rows whose step time is training alone (see timed_rows)
  config: dict | None  # config.json, or None when the workdir has none


def load_run(workdir: str, name: str | None = None) -> Run:
  """The run in `workdir`, named by its directory unless `name` is given."""
  if not os.path.isdir(workdir):
    raise RunError(f"{workdir}: no such directory")
  if not os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
    raise RunError(f"{workdir}: no metrics.jsonl; is it a training workdir?")
  raw = read_metrics(workdir)
  rows = [r for r in raw if "event" not in r and "step" in r]
  if not rows:
    raise RunError(f"{workdir}: metrics.jsonl has no logged steps")
  name = name or os.path.basename(os.path.normpath(workdir))
  return Run(name, rows, timed_rows(raw), read_config(workdir))


def read_config(workdir: str) -> dict | None:
  """DIR/config.json as a dict, or None when there is none."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise RunError(f"{path}: not valid JSON ({e})") from e


def load_runs(workdirs: list[str]) -> list[Run]:
  """The runs, named by directory; by their whole path where two directories share a name."""
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  return [load_run(w, n if names.count(n) == 1 else os.path.normpath(w)) for w, n in zip(workdirs, names)]


class Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag as one line on stderr with exit status 2, without the usage block."""

  def error(self, message):
    fail(f"{self.prog}: {message}")


def fail(message: str):
  print(message, file=sys.stderr)
  sys.exit(2)
