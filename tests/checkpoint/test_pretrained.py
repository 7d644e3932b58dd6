"""load_pretrained and the checkpoint readers live in pretrained.py: hf.py imports neither it nor convert."""

import ast
import os

import jaxtrain
from jaxtrain.checkpoint import convert, pretrained
from tests.fixtures import ROOT


def jaxtrain_imports(module: str) -> set[str]:
  """Every jaxtrain module a source file imports, at any depth (lazy imports included)."""
  path = os.path.join(ROOT, *module.split(".")) + ".py"
  names = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxtrain"):
      names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      names |= {a.name for a in node.names if a.name.startswith("jaxtrain")}
  return names


def test_no_import_cycle_between_hf_convert_and_pretrained():
  hf_imports = jaxtrain_imports("jaxtrain.checkpoint.hf")
  assert not hf_imports & {"jaxtrain.checkpoint.convert", "jaxtrain.checkpoint.pretrained"}, hf_imports
  assert "jaxtrain.checkpoint.convert" not in jaxtrain_imports("jaxtrain.checkpoint.pretrained")


def test_load_pretrained_is_pretrained_module():
  assert jaxtrain.load_pretrained is pretrained.load_pretrained
  assert convert.load_params is pretrained.load_params and convert.find_step is pretrained.find_step
