"""Exposed and hidden communication in compiled schedules (compiled for targets deviceless, not
executed): per target, the share of a step's matmul FLOPs that runs beside FSDP's all-gathers and
reduce-scatters with the compiler's defaults and with targets.ASYNC_FLAGS, and streaming DiLoCo's
bytes over `replica` that overlap compute at one step a call and at 4 (the syncs sent inside the
call land in it). The configs are tests/targets/test_exposed.py's (tiny's model at d_model 128).
Results: benchmarks/RESULTS.md, "Exposed and hidden communication".

  JAX_PLATFORMS=cpu .venv-targets/bin/python benchmarks/exposed_comm.py [--targets h100:8,...]
"""

import argparse
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from jaxtrain.aot.compile import scheduled  # noqa: E402
from jaxtrain.parallel import hlo_bytes, hlo_schedule  # noqa: E402
from jaxtrain.train import comm  # noqa: E402
from tests.targets.test_exposed import fsdp_config  # noqa: E402
from tests.targets.test_overlap import config as diloco_config  # noqa: E402


def fsdp_share(target: str, flags: bool) -> tuple[float, float]:
  """(share of the step's matmul FLOPs beside FSDP's gathers and reductions, share of their bytes
  whose transfer has matmuls beside it)."""
  text, mesh, _, _ = scheduled(fsdp_config(), target, async_flags=flags)
  win = hlo_schedule.windows(text)
  rows = [r for r in hlo_bytes.collectives(text, mesh)
          if "fsdp" in r.axes and r.kind in ("all-gather", "reduce-scatter")]
  hidden = sum(r.per_step for r in rows if win.of(r.name) > 0)
  return sum(win.of(r.name) for r in rows) / win.flops, hidden / sum(r.per_step for r in rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default="h100:8,tpu-v5e:2x4")
  args = parser.parse_args()
  print("| target | case | defaults | ASYNC_FLAGS |")
  print("|---|---|---:|---:|")
  for target in args.targets.split(","):
    shares = {flags: fsdp_share(target, flags) for flags in (False, True)}
    print(f"| {target} | FSDP 8: matmul FLOPs beside its gathers/reductions | "
          f"{shares[False][0]:.3f} | {shares[True][0]:.3f} |")
    print(f"| {target} | FSDP 8: bytes of gathers/reductions with matmuls beside them | "
          f"{shares[False][1]:.3f} | {shares[True][1]:.3f} |")
  print()
  print("| target | DiLoCo steps a call | bytes/step over replica | overlap compute | exposed |")
  print("|---|---:|---:|---:|---:|")
  for target in args.targets.split(","):
    for k, m in zip((1, 4), comm.measure([diloco_config(1), diloco_config(4)], target=target)):
      print(f"| {target} | {k} | {m['reduced']:,.0f} | {m['overlapped']:,.0f} | "
            f"{m['reduced'] - m['overlapped']:,.0f} |")


if __name__ == "__main__":
  main()
