"""notebooks/: committed without outputs, each with a `STEPS` parameters cell that CI overrides, a guarded
install cell; tools/run_notebooks.py fails on an error or a printed warning in any cell. CI executes the
notebooks themselves with `python tools/run_notebooks.py` (.ci/run)."""

import glob
import os
import queue
import time

import nbformat
import psutil
import pytest

from tests.fixtures import ROOT
from tools import run_notebooks

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def code(nb) -> list[str]:
  return [c.source for c in nb.cells if c.cell_type == "code"]


def test_the_four_notebooks_are_there():
  assert [os.path.basename(p) for p in NOTEBOOKS] == ["finetune_hf.ipynb", "quickstart.ipynb",
                                                      "sharding_tour.ipynb", "vision_language.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_without_outputs_with_a_steps_parameter_and_a_guarded_install(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  cells = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None for c in cells)
  params = [c for c in cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1 and 'STEPS = int(os.environ.get("JAXTRAIN_NB_STEPS",' in params[0].source
  install = [s for s in code(nb) if "pip" in s]
  assert len(install) == 1 and 'if importlib.util.find_spec("jaxtrain") is None:' in install[0]
  first_jax = next(i for i, s in enumerate(code(nb)) if "import jax\n" in s or "import jaxtrain" in s)
  assert code(nb).index(params[0].source) < first_jax  # STEPS is known before anything runs


def test_the_sharding_tour_sets_8_devices_before_jax():
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "sharding_tour.ipynb"), as_version=4)
  first = code(nb)[0]
  assert "--xla_force_host_platform_device_count=8" in first and "import jax" not in first


def write(tmp_path, *sources) -> str:
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
  path = str(tmp_path / "t.ipynb")
  nbformat.write(nb, path)
  return path


def test_runner_passes_steps_and_fails_on_an_error_or_a_warning(tmp_path):
  nb, _ = run_notebooks.run(write(tmp_path, "import os; print(os.environ['JAXTRAIN_NB_STEPS'], os.getcwd())",
                                  "import tqdm.auto\nfor _ in tqdm.auto.tqdm(range(3)): pass"), steps=3)
  steps, cwd = nb.cells[0].outputs[0].text.split()
  assert steps == "3" and cwd != os.getcwd() and not cwd.startswith(ROOT)
  assert run_notebooks.progress_bars(nb) == 1  # tqdm.auto is the notebook front end: a widget, no text
  assert not psutil.Process().children(recursive=True)  # the kernel is shut down
  with pytest.raises(run_notebooks.NotebookFailed, match=r"(?s)t.ipynb: .*ZeroDivisionError"):
    run_notebooks.run(write(tmp_path, "x = 1", "1 / 0", "x = 2"))
  with pytest.raises(run_notebooks.NotebookFailed, match="cell 1 printed a warning: UserWarning"):
    run_notebooks.run(write(tmp_path, "x = 1", "import warnings; warnings.warn('careful')"))


INTERRUPTED = '''
import jaxtrain
from tests.fixtures import tiny_config
final = jaxtrain.train(tiny_config(train=dict(steps=100000)), "run", progress=False)
saves = [r["step"] for r in jaxtrain.read_metrics("run", as_frame=False) if r.get("event") == "checkpoint_save"]
print("RESULT", final.get("preempted"), final["step"], saves)
'''


@pytest.mark.slow  # a kernel, jax and a compilation: ~20 s
def test_interrupting_the_kernel_saves_and_returns(tmp_path):
  """The notebook's stop button (SIGINT to the kernel) during `jaxtrain.train`: a checkpoint at the step it
  stopped, the cell returns normally with `preempted` set."""
  km = run_notebooks.kernel_manager(str(tmp_path / "kernel"))
  km.start_kernel(env=run_notebooks.kernel_env(4), cwd=str(tmp_path))
  kc = km.client()
  kc.start_channels()
  try:
    kc.wait_for_ready(timeout=120)
    msg_id, out, interrupted = kc.execute(INTERRUPTED), [], False
    metrics_path = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline:
      if not interrupted and metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 5:
        km.interrupt_kernel()
        interrupted = True
      try:
        msg = kc.get_iopub_msg(timeout=0.5)
      except queue.Empty:
        continue
      if msg["parent_header"].get("msg_id") != msg_id:
        continue
      if msg["msg_type"] in ("stream", "error"):
        out.append(msg["content"].get("text") or f"{msg['content']['ename']}: {msg['content']['evalue']}")
      if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
        break
  finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
  assert interrupted
  line = next(x for x in "".join(out).splitlines() if x.startswith("RESULT"))
  _, why, step, saves = line.split(" ", 3)
  assert why == "SIGINT" and 4 <= int(step) < 100000 and saves == f"[{step}]", out
