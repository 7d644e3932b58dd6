"""The built wheel holds every jaxtrain package and the configs, so that the README's library example
(`jaxtrain.get_config("configs/tiny.py")`) works after `pip install` outside the repository."""

import glob
import os
import subprocess
import sys
import tomllib
import zipfile

from tests.fixtures import ROOT


def test_setuptools_package_list_covers_the_tree():
  listed = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"])
  found = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(ROOT, "jaxtrain"))
           if "__init__.py" in files}
  assert found | {"jaxtrain.configs"} == listed


def test_wheel_ships_configs_and_they_load_outside_the_repository(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                  str(tmp_path), ROOT], check=True, capture_output=True)
  wheel = next(p for p in os.listdir(tmp_path) if p.endswith(".whl"))
  names = zipfile.ZipFile(tmp_path / wheel).namelist()
  assert "jaxtrain/configs/tiny.py" in names and "jaxtrain/train/loop.py" in names
  site = tmp_path / "site"
  zipfile.ZipFile(tmp_path / wheel).extractall(site)
  code = ("import jaxtrain; c = jaxtrain.get_config('configs/tiny.py'); print(c.train.steps, "
          "jaxtrain.get_config('moe_tiny:fine').model.n_experts, jaxtrain.__file__)")
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(site)}).stdout.split()
  assert out[:2] == ["400", "32"] and out[2].startswith(str(site))


def test_library_names_the_readme_uses():
  """`jaxtrain.train(...)` is the loop and `jaxtrain.train.make_train_step` the step (the function used to
  shadow the subpackage: `jaxtrain.train.train_step` was an AttributeError); read_metrics and plot are exported."""
  import jaxtrain
  from jaxtrain.core import step
  from jaxtrain.train import loop
  assert callable(jaxtrain.train) and jaxtrain.train.loop is loop
  assert jaxtrain.train.make_train_step is step.make_train_step
  assert step.make_train_step is jaxtrain.core.step.make_train_step
  assert callable(jaxtrain.read_metrics) and jaxtrain.plot is jaxtrain.plotting.plot
  assert jaxtrain.Task is jaxtrain.train.Task


# modules that only the user of an optional extra imports, with that extra
OPTIONAL = {"jaxtrain/eval/adapter.py": "eval"}


def test_every_module_level_import_is_a_declared_dependency():
  """A fresh `pip install jaxtrain` has what its modules import at load time: a package that arrives only
  through the test extra (Pillow came with matplotlib) would pass every test here and fail on import there."""
  import ast
  import importlib.metadata
  import re
  project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
  norm = lambda name: re.split(r"[<>=\[ ;]", name)[0].lower().replace("_", "-")
  declared = {norm(d) for d in project["dependencies"]}
  owners = importlib.metadata.packages_distributions()
  undeclared = []
  for path in sorted(glob.glob(os.path.join(ROOT, "jaxtrain", "**", "*.py"), recursive=True)):
    rel = os.path.relpath(path, ROOT)
    allowed = declared | {norm(d) for d in project["optional-dependencies"].get(OPTIONAL.get(rel, ""), [])}
    for node in ast.parse(open(path).read()).body:
      if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        modules = [node.module]
      else:
        continue
      for top in {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"jaxtrain"}:
        if not {norm(d) for d in owners.get(top, [top])} & allowed:
          undeclared.append(f"{rel}: {top}")
  assert not undeclared, undeclared
