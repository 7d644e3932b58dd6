"""Trains one run per learning rate in config.ARGS from scratch, then prints the comparison and plots the curves.

  python experiments/lr_sweep_tiny/run.py [--root runs/lr_sweep_tiny]

Writes the workdirs under --root and the plot beside this file (curves.png)."""

import argparse
import datetime
import importlib.util
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain and tools, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402

import jaxtrain  # noqa: E402
from tools.compare_runs import compare, format_table  # noqa: E402
from tools.plot_metrics import plot  # noqa: E402


def load_study_config():
  """This folder's config.py as a module (its get_config and ARGS)."""
  spec = importlib.util.spec_from_file_location("lr_sweep_tiny_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=os.path.join(ROOT, "runs", "lr_sweep_tiny"), help="where the workdirs go")
  args = parser.parse_args()
  study = load_study_config()
  print(f"{datetime.date.today()}, jax {jax.__version__}, {platform.python_version()}, {jax.devices()[0].device_kind}"
        f" x {jax.device_count()}, {os.cpu_count()} cores", flush=True)
  workdirs = []
  for arg in study.ARGS:
    workdirs.append(os.path.join(args.root, f"lr_{arg}"))
    final = jaxtrain.train(study.get_config(arg), workdirs[-1], progress=False, start_over=True)
    print(f"lr={arg}: step {final['step']}, loss {final['loss']:.4f}", flush=True)
  print(format_table(*compare(workdirs), "md"))
  plot(workdirs, os.path.join(HERE, "curves.png"))
  print(f"wrote {os.path.join(HERE, 'curves.png')}")


if __name__ == "__main__":
  main()
