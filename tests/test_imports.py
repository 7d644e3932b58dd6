"""Imports point one way (docs/ARCHITECTURE.md):

  config -> data -> collectives / kernels / wire -> model -> parallel -> optim -> core -> posttrain
    -> builder -> plan -> aot -> train / eval  (checkpoint / metrics: sinks, imported from core on)

no module imports itself back through others (no import circle, lazy imports included), and
`import jaxtrain` / `python -m jaxtrain --help` import no jax at all."""

import ast
import os
import re
import subprocess
import sys

from tests.fixtures import ROOT

PACKAGE = os.path.join(ROOT, "jaxtrain")
# A module's layer is its first name under jaxtrain; modules in one layer may import each other.
LAYERS = [{"config", "errors"}, {"config_files"}, {"data"}, {"collectives", "kernels", "wire"},
          {"model"}, {"parallel"}, {"optim"}, {"core"}, {"posttrain"}, {"builder"}, {"plan"},
          {"aot"}, {"train", "eval", "launch"}, {"plotting"}]
SINKS = {"checkpoint", "metrics"}  # take any pytree or dict; imported by core and later layers
INTEROP = {"jaxtrain.checkpoint.hf", "jaxtrain.checkpoint.hf_rope", "jaxtrain.checkpoint.pretrained",
           "jaxtrain.checkpoint.convert", "jaxtrain.checkpoint.hf_bert"}
ROOTS = {None, "__main__"}  # the package face and the CLI may import anything of jaxtrain


def rank(layer: str) -> int:
  return next(i for i, names in enumerate(LAYERS) if layer in names)


def layer_of(module: str):
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def imports(path):
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "jaxtrain":
        yield from (f"jaxtrain.{a.name}" for a in node.names)
      else:
        yield node.module
    elif isinstance(node, ast.Import):
      yield from (a.name for a in node.names)


def allowed(module: str, src, dst) -> bool:
  if src == dst:
    return True
  if module in INTEROP:  # HF interop maps checkpoints to the model's config and modules
    return dst in ("config", "errors", "model")
  if src in SINKS:
    return dst in ("config", "errors")
  if dst not in SINKS and rank(dst) == rank(src):  # modules in one layer may import each other
    return True
  if dst in SINKS:
    return rank(src) >= rank("core")
  return src not in SINKS and rank(dst) < rank(src)


def modules():
  for dirpath, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        yield path, os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").replace(".__init__", "")


def test_imports_point_left():
  bad = []
  for path, module in modules():
    src = layer_of(module)
    for target in imports(path):
      top = target.split(".")[0]
      if top in ("tools", "experiments", "benchmarks", "tests"):
        bad.append(f"{module} imports {target}: jaxtrain never imports the folders around it")
      elif top == "jaxtrain" and src not in ROOTS and not allowed(module, src, layer_of(target)):
        bad.append(f"{module} imports {target}")
  assert not bad, bad


def module_graph() -> dict[str, set[str]]:
  """module -> the jaxtrain modules it imports (at the top or lazily): `from pkg import name` is
  pkg.name when that is a module, else pkg. A package's __init__ re-exporting its own modules is no
  circle."""
  paths = {module: path for path, module in modules()}
  graph = {}
  for module, path in paths.items():
    targets = set()
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        named = (f"{node.module}.{a.name}" for a in node.names)
        targets.update(name if name in paths else node.module for name in named)
      elif isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
    graph[module] = {t for t in targets if t in paths and t != module
                     and not (path.endswith("__init__.py") and t.startswith(module + "."))}
  return graph


def test_no_import_circle():
  graph, circles = module_graph(), []
  for start in sorted(graph):  # a path from start back to start, depth first
    stack, seen = [(start, (start,))], set()
    while stack:
      module, path = stack.pop()
      for target in sorted(graph[module]):
        if target == start and start == min(path):  # each circle once, from its first module
          circles.append(" -> ".join((*path, start)))
        elif target not in seen:
          seen.add(target)
          stack.append((target, (*path, target)))
  assert not circles, circles


def test_every_module_has_a_layer():
  unknown = {layer_of(m) for _, m in modules()} - ROOTS - SINKS - set().union(*LAYERS)
  assert not unknown, f"add these to LAYERS in the right place: {unknown}"


def test_config_and_errors_do_not_import_jax():
  config = sorted(f"config/{f}" for f in os.listdir(os.path.join(PACKAGE, "config"))
                  if f.endswith(".py"))
  for name in (*config, "config_files.py", "errors.py"):
    src = open(os.path.join(PACKAGE, name)).read()
    assert not re.search(r"^\s*(import|from) jax\b", src, re.M), name


def imported_modules(*args: str) -> set[str]:
  """Top-level module names Python imported (python -X importtime) while running `args`."""
  run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  names = [line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
  return {n.split(".")[0] for n in names[1:]}  # the first line is the header


def test_import_jaxtrain_imports_no_jax():
  loaded = imported_modules("-c", "import jaxtrain; jaxtrain.get_config; jaxtrain.default_config()")
  assert "jaxtrain" in loaded and not loaded & {"jax", "jaxlib", "flax", "optax", "orbax"}, sorted(loaded)


def test_cli_help_imports_no_jax():
  loaded = imported_modules("-m", "jaxtrain", "--help")
  assert "jaxtrain" in loaded and not loaded & {"jax", "jaxlib", "flax", "optax", "orbax"}, sorted(loaded)


def test_launch_imports_no_jax():
  """launch only manages `train` subprocesses: the launcher itself loads no jax."""
  loaded = imported_modules("-c", "from jaxtrain.__main__ import main; main(['launch', '--help'])")
  assert "jaxtrain" in loaded and not loaded & {"jax", "jaxlib", "flax", "optax", "orbax"}, sorted(loaded)
