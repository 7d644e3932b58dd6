"""Imports point one way: config -> data -> model -> parallel -> optim -> train -> checkpoint/metrics."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxtrain")
ORDER = ["config", "data", "kernels", "model", "parallel", "optim", "train"]
SINKS = {"checkpoint", "metrics"}  # take any pytree or dict; import nothing of jaxtrain but config


def layer_of(module: str) -> str:
  return module.split(".")[1] if "." in module else module


def imports(path):
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxtrain"):
      names = [node.module] if node.module != "jaxtrain" else [f"jaxtrain.{a.name}" for a in node.names]
      yield from names
    elif isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name.startswith("jaxtrain"))


def test_imports_point_left():
  bad = []
  for dirpath, _, files in os.walk(ROOT):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
      src = layer_of(rel.replace(".__init__", "")) if rel != "jaxtrain.__init__" else None
      if src in (None, "__main__"):
        continue  # the package root and the CLI may import anything
      for target in imports(path):
        dst = layer_of(target)
        if dst in (src, "errors"):  # errors.py: the run-ending exceptions, a leaf that any layer may raise
          continue
        if rel == "jaxtrain.checkpoint.hf":  # HF interop (a checkpoint concern) maps to the model's config
          ok = dst in ("config", "model")
        elif src in SINKS:
          ok = dst == "config"
        elif dst in SINKS:
          ok = src == "train"
        else:
          ok = src in ORDER and dst in ORDER and ORDER.index(dst) < ORDER.index(src)
        if not ok:
          bad.append(f"{rel} imports {target}")
  assert not bad, bad


def test_config_does_not_import_jax():
  src = open(os.path.join(ROOT, "config.py")).read()
  assert "import jax" not in src and "from jax" not in src
