"""Executes notebooks top to bottom on CPU, as CI does, with a small step budget; fails on an error in any cell
and on a warning that a cell prints.

  python tools/run_notebooks.py [NOTEBOOK ...] [--steps N] [--timeout S] [--keep DIR] [--jobs J]

Default: every notebooks/*.ipynb. Each runs in a fresh kernel (ipykernel of this Python, driven by nbclient)
whose working directory is a new temporary folder (its runs/ land there), with this repository first on
PYTHONPATH, JAX_PLATFORMS=cpu, no XLA_FLAGS (a notebook sets its own) and JAXTRAIN_NB_STEPS=N (the
notebooks' `STEPS`). `--keep DIR` writes the executed notebooks there. `--jobs J` runs J notebooks
at a time (their kernels are separate processes). Exit status 1 names the notebook and the cell; 0
prints one line per notebook with its time, as each ends."""

import argparse
import concurrent.futures
import glob
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = "jaxtrain-notebooks"
WIDGET = "application/vnd.jupyter.widget-view+json"  # a tqdm.notebook progress bar's output
WARNING = re.compile(r"\b\w*Warning\b|^WARNING\b|^[WE]\d{4} |IProgress not found", re.M)  # + XLA's glog lines


class NotebookFailed(Exception):
  """A cell raised, or printed a warning; the message names the notebook and the cell."""


def kernel_env(steps: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", JAXTRAIN_NB_STEPS=str(steps), PYTHONWARNINGS="default",
             PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
  return env


def kernel_manager(spec_root: str):
  """A kernel manager for ipykernel of this very Python (a kernelspec written under `spec_root`), whatever
  kernelspecs the machine has."""
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import KernelManager
  spec_dir = os.path.join(spec_root, KERNEL)
  os.makedirs(spec_dir, exist_ok=True)
  with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
    json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
               "display_name": KERNEL, "language": "python"}, f)
  return KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[spec_root]),
                       transport="ipc", ip=os.path.join(spec_root, "kernel-ipc"))  # no TCP port: no warning


def run(path: str, steps: int = 4, timeout: int = 1200, keep: str | None = None):
  """Executes the notebook at `path`; returns (the executed notebook, seconds). NotebookFailed on an error
  or a printed warning."""
  import nbformat
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError
  nb = nbformat.read(path, as_version=4)
  name = os.path.basename(path)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="nb_") as tmp:
    cwd = os.path.join(tmp, "work")
    os.makedirs(cwd)
    km = kernel_manager(os.path.join(tmp, "kernel"))
    client = NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": cwd}})
    try:
      client.execute(env=kernel_env(steps))
    except CellExecutionError as e:
      raise NotebookFailed(f"{name}: {e}") from None
    finally:
      if km.has_kernel:  # nbclient leaves a kernel it was given running
        km.shutdown_kernel(now=True)
      if keep:
        os.makedirs(keep, exist_ok=True)
        nbformat.write(nb, os.path.join(keep, name))
  for index, cell in enumerate(nb.cells):
    for out in cell.get("outputs", []):
      text = out.get("text", "") if out.get("output_type") == "stream" else ""
      if out.get("name") == "stderr" and WARNING.search(text):
        raise NotebookFailed(f"{name}: cell {index} printed a warning: {WARNING.search(text).group(0)}: "
                             f"{text.strip().splitlines()[-1][:300]}")
  return nb, time.perf_counter() - start


def progress_bars(nb) -> int:
  """How many notebook progress bars (widgets) the executed notebook shows."""
  return sum(WIDGET in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="run_notebooks.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
  parser.add_argument("--steps", type=int, default=4, help="JAXTRAIN_NB_STEPS: each notebook's STEPS")
  parser.add_argument("--timeout", type=int, default=1200, help="seconds one cell may take")
  parser.add_argument("--keep", metavar="DIR", help="write the executed notebooks here")
  parser.add_argument("--jobs", type=int, default=1, help="notebooks run at a time")
  args = parser.parse_args(argv)
  paths = args.notebooks or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
  if not paths:
    print("run_notebooks.py: no notebooks", file=sys.stderr)
    return 2
  start, failed = time.perf_counter(), []
  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    runs = {pool.submit(run, path, args.steps, args.timeout, args.keep): path for path in paths}
    for done in concurrent.futures.as_completed(runs):
      try:
        nb, seconds = done.result()
      except NotebookFailed as e:
        failed.append(str(e))
        print(f"run_notebooks.py: FAILED {e}", file=sys.stderr, flush=True)
        continue
      name = os.path.basename(runs[done])
      print(f"{name}: ok in {seconds:.0f} s ({progress_bars(nb)} progress bars)", flush=True)
  if failed:
    return 1
  print(f"all notebooks: {time.perf_counter() - start:.0f} s")
  print(f"{len(paths)} passed, 0 failed")
  return 0


if __name__ == "__main__":
  sys.exit(main())
