"""The bitwise reference for "behaviour unchanged": the first 30 losses (and the eval loss at step 30)
of `tiny`, `moe_tiny` on 2 data x 4 expert, and `text_tiny` on a corpus made here.

Recorded once from the commit before the seams refactor (`python -m tests.train.seams_reference --record`)
into tests/golden/seams_losses.json; tests/train/test_seams_bitwise.py compares every later commit
against it, float for float, on XLA:CPU with 8 virtual devices. One reference per kind of CPU:
XLA:CPU's code differs between them (an Intel Xeon and an AMD EPYC host differ in the last bit from
tiny's fifth step on; two EPYC generations from its fourth), so each was recorded from that commit
(6a18526) on its own kind of host. The first ones are keyed by vendor alone (GenuineIntel,
AuthenticAMD); later ones by `fixtures.cpu_kind()` (vendor, family and model), which wins where both
are recorded."""

import json
import os
import sys

from tests.fixtures import ROOT, cpu_kind, cpu_vendor

STEPS = 30
FIXTURE = os.path.join(ROOT, "tests", "golden", "seams_losses.json")  # {cpu vendor: {config: losses}}


def reference_key(recorded: dict) -> str | None:
  """This host's reference: the one of its kind of CPU, else its vendor's, else None."""
  return next((key for key in (cpu_kind(), cpu_vendor()) if key in recorded), None)


def write_corpus(directory: str) -> str:
  """A deterministic text corpus: 120 documents of pseudo-English, a few KiB each."""
  import random
  rng = random.Random(1234)
  words = ("the a model trains on tokens of text and learns to predict which word comes next in every "
           "sentence while its loss falls towards the entropy of the language").split()
  os.makedirs(directory, exist_ok=True)
  for i in range(120):
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + "." for _ in range(rng.randint(5, 40))]
    with open(os.path.join(directory, f"doc_{i:03d}.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")
  return os.path.join(directory, "*.txt")


def configs(tmp: str) -> dict:
  from jaxtrain.config_files import load_config_file
  out = {}
  for name in ("tiny", "moe_tiny", "text_tiny"):
    cfg = load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    cfg.train.update(steps=STEPS, log_every=1, eval_every=STEPS, eval_batches=1)
    cfg.optim.update(warmup_steps=10)
    # the implementations the reference ran with: CPU's auto has since chosen query blocks for
    # attention and einsums for the projections' gradients (same values, other roundings)
    cfg.model.update(attention="xla", projection_vjp="jax")
    if name == "moe_tiny":
      cfg.mesh.update(data=2, expert=4)
    if name == "text_tiny":
      cfg.data.path = write_corpus(os.path.join(tmp, "corpus"))
    out[name] = cfg
  return out


def losses(cfg, workdir: str) -> dict:
  import jaxtrain
  from jaxtrain import metrics
  jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  return {"loss": [r["loss"] for r in rows], "eval_loss": [r["eval_loss"] for r in rows if "eval_loss" in r]}


def main():
  import tempfile
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  with tempfile.TemporaryDirectory() as tmp:
    result = {name: losses(cfg, os.path.join(tmp, name)) for name, cfg in configs(tmp).items()}
  result["jax"] = jax.__version__
  if "--record" in sys.argv:
    recorded = json.load(open(FIXTURE)) if os.path.exists(FIXTURE) else {}
    recorded[cpu_kind()] = result
    with open(FIXTURE, "w") as f:
      json.dump(recorded, f, indent=1)
  print(json.dumps(result)[:400])


if __name__ == "__main__":
  main()
