"""Modelled wall time per step of a 1B-class model under Streaming DiLoCo, with the overlap its
compiled schedule gives and without any, at 1/10/100 Gbit/s between replicas.

  python experiments/comm_efficiency/overlap.py [--targets tpu-v5p:2x2x2,h200:8] [--only f32:1,...]
      [--out DIR] [--again]

Each row is saved in overlap.json as it comes; a rerun compiles only the rows not there yet
(--again: all of them again).

configs/llama_1b.py's model (1.24B parameters; XLA attention, full remat, layers unrolled) as 8
DiLoCo replicas of one chip each, batch 16 x 2048 tokens (2 sequences a replica), Streaming DiLoCo
with H = 8 inner steps and 2 fragments (a fragment sync every 4 steps), each applied one step after
it is sent, with float32 and int8 outer gradients. Each scheme is compiled deviceless for each
target (jaxtrain.aot, with the asynchronous-collective flags of targets.ASYNC_FLAGS) twice: one step
a call (the sync runs inside the step that sends it) and 8 steps a call (train.steps_per_call=8:
each sync issued at its step and consumed a step later; the one sent at the call's 4th step lands
inside the program, so the scheduler may run the 5th step beside it; the one sent at the last step
must finish in its call, half of the syncs); and float32 at 8 steps a call applied 4 steps after
it is sent (ARGS' "f32:8:4"). From each compiled module
(comm.measure): the bytes per device over the replica axis, and per collective the matmul FLOPs
the schedule runs while its transfer is in flight.

The model (stated, not measured; nothing here ran on a TPU or GPU): a step computes for
T = (the module's matmul FLOPs per device per step) / (the chip's dense bf16 peak x 0.4);
a collective's transfer takes bytes x 8 / bandwidth on the replica link, less the compute the
schedule runs beside it (comm.exposed_s); wall = T + exposed; without overlap, wall = T + every
transfer. No latency, contention or compute slowdown from the transfer is modelled.

Needs libtpu and the CUDA plugin (`make test-targets` installs them in .venv-targets): run it with
.venv-targets/bin/python. It sets JAX_PLATFORMS=cpu itself."""

import argparse
import datetime
import json
import os
import platform
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402

from jaxtrain import config_files  # noqa: E402
from jaxtrain.aot import targets as targets_lib  # noqa: E402
from jaxtrain.train import comm  # noqa: E402

MARKERS = ("<!-- overlap:begin -->", "<!-- overlap:end -->")
GBITS = (1, 10, 100)
MFU = 0.4
STEPS_PER_CALL = 8
FORMATS = ("f32", "int8")


# each format one step a call and 8, and f32 with its syncs applied 4 steps late (4 steps of compute
# to hide behind, if the scheduler spreads the transfer over them)
ARGS = tuple(f"{fmt}:{k}" for fmt in FORMATS for k in (1, STEPS_PER_CALL)) + (
    f"f32:{STEPS_PER_CALL}:4",)


def get_config(arg: str = f"f32:{STEPS_PER_CALL}"):
  """One scheme of the study: "FORMAT:STEPS_PER_CALL[:DELAY]" (ARGS; the delay defaults to 1)."""
  fmt, steps_per_call, delay = parse(arg)
  cfg = config_files.load_config_file("configs/llama_1b.py")
  # XLA attention: the Pallas kernel's per-shard map does not nest in the replica axis. Full remat:
  # with remat=dots a step needs 190 GiB per H100 (117 GiB on a v5p). Batch 16: at 32 the 8-step
  # call needs 97.04G of temporaries on a v5p (95.74G of HBM). Layers unrolled: XLA:GPU's
  # scheduler moves no transfer across a while loop, so with scan_layers the sync spans no matmul
  # of the next step (measured here, benchmarks/RESULTS.md)
  cfg.model.update(attention="xla", remat="full", scan_layers=False)
  cfg.mesh.update(replica=8, data=1, fsdp=1)
  cfg.train.update(batch_size=16, seq_len=2048, steps_per_call=steps_per_call)
  cfg.diloco.update(inner_steps=8, fragments=2, delay=delay, format=fmt)
  return cfg


def model(measured: dict, chip) -> dict:
  """Compute time per step and, per link speed, the seconds of transfer per step and the wall time
  per step with the schedule's overlap and without any."""
  t = measured["flops"] / (chip.bf16_flops * MFU)
  out = {"compute_s": t, "flops": measured["flops"], "bytes": measured["reduced"],
         "overlapped_bytes": measured["overlapped"], "parts": measured["parts"], "links": {}}
  for gbit in GBITS:
    comm_s = measured["reduced"] * 8 / (gbit * 1e9)
    exposed = comm.exposed_s(measured["parts"], 1.0, gbit, t)
    out["links"][gbit] = {"comm_s": comm_s, "exposed_s": exposed, "wall_s": t + exposed,
                          "wall_serial_s": t + comm_s}
  return out


def parse(arg: str) -> tuple[str, int, int]:
  fmt, k, *delay = arg.split(":")
  return fmt, int(k), int(delay[0]) if delay else 1


def format_table(rows: list[dict]) -> str:
  lines = ["| target | outer gradients | steps a call | delay | compute T (s) | "
           "bytes/step over replica | "
           "of them overlapping | " + " | ".join(f"{g} Gbit/s: wall (no overlap)" for g in GBITS)
           + " |", "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(GBITS)]
  for r in rows:
    share = r["overlapped_bytes"] / r["bytes"] if r["bytes"] else 0.0
    cells = [f"{r['links'][g]['wall_s']:.3f} ({r['links'][g]['wall_serial_s']:.3f})"
             for g in GBITS]
    lines.append(f"| {r['target']} | {r['format']} | {r['steps_per_call']} | {r['delay']} | "
                 f"{r['compute_s']:.3f} | {r['bytes']:,.0f} | {share:.0%} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def write(rows: list[dict], out: str):
  """overlap.json and overlap.md in `out`, and the README's table when `out` is this folder."""
  table = format_table(rows)
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
          "python": platform.python_version(), "host": platform.processor() or platform.machine(),
          "mfu": MFU, "rows": rows}
  with open(os.path.join(out, "overlap.json"), "w") as f:
    json.dump(meta, f, indent=1)
  with open(os.path.join(out, "overlap.md"), "w") as f:
    f.write(table + "\n")
  readme = os.path.join(HERE, "README.md")
  text = open(readme).read()
  if out == HERE and MARKERS[0] in text:
    head, rest = text.split(MARKERS[0])
    text = f"{head}{MARKERS[0]}\n{table}\n{MARKERS[1]}{rest.split(MARKERS[1], 1)[1]}"
    with open(readme, "w") as f:
      f.write(text)
  return table


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default="tpu-v5p:2x2x2,h200:8")
  parser.add_argument("--only", default=",".join(ARGS), help="schemes to compile (FORMAT:K)")
  parser.add_argument("--out", default=HERE)
  parser.add_argument("--again", action="store_true", help="recompile rows already in overlap.json")
  args = parser.parse_args()
  saved = os.path.join(args.out, "overlap.json")
  rows = json.load(open(saved))["rows"] if os.path.exists(saved) and not args.again else []
  for r in rows:  # JSON keeps the link speeds as strings
    r["links"] = {int(gbit): v for gbit, v in r["links"].items()}
    r.setdefault("delay", 1)
  key = lambda r: (r["target"], r["format"], r["steps_per_call"], r["delay"])  # noqa: E731
  done = {key(r) for r in rows}
  for target in args.targets.split(","):
    chip = targets_lib.parse(target).chip
    for arg in args.only.split(","):
      fmt, k, delay = parse(arg)
      if (target, fmt, k, delay) in done:
        continue
      measured = comm.measure([get_config(arg)], target=target)[0]
      row = {"target": target, "format": fmt, "steps_per_call": k, "delay": delay,
             **model(measured, chip)}
      rows.append(row)
      print(format_table([row]).splitlines()[-1], flush=True)
      # each row saved as it comes: an interrupted study resumes where it stopped
      rows.sort(key=lambda r: (r["target"], FORMATS.index(r["format"]), r["steps_per_call"],
                               r["delay"]))
      write(rows, args.out)
  print(write(rows, args.out))


if __name__ == "__main__":
  main()
