"""One process of a (possibly multi-process) CPU training run, for tests/test_multiprocess.py.

  python tests/multiprocess_worker.py --process_id=I --num_processes=N --port=P --workdir=DIR \
      --devices_per_process=D [--overrides=JSON]

Every process joins `jax.distributed` (gloo CPU collectives) when N > 1, trains the tiny config on a
global mesh of N * D devices, and writes DIR/process_I.json: the rows of each global batch it fed
(`Feed.lo/hi`), its device counts, the processes of each replica of the mesh and the metrics `train`
returned. `--overrides` ({section: {key: value}}) changes config sections; its `mesh`, when given,
replaces MESH whole. Process 0 also writes DIR/metrics.jsonl (jaxtrain does that).

JT_BREAK_SAVES=S1,S2 (the disk fault of tests/checkpoint/test_faults.py, on process 0 alone): while
process 0 saves one of those steps, the persistent tier's parent directory is a regular file, so the
step directory Orbax makes there (on process 0 alone) cannot be made.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tiny run that the 1-process reference and every multi-process run share: same global mesh
# (data=2 x fsdp=4 = 8 devices) and same global batch.
TRAIN = dict(steps=8, batch_size=16, seq_len=16, log_every=1, eval_every=4, eval_batches=1)
MESH = dict(data=2, fsdp=4)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--process_id", type=int, required=True)
  p.add_argument("--num_processes", type=int, required=True)
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--workdir", required=True)
  p.add_argument("--devices_per_process", type=int, required=True)
  p.add_argument("--overrides", default="{}", help="JSON {section: {key: value}} over TRAIN and MESH")
  return p.parse_args(argv)


def main(args):
  xla_flags = f"--xla_force_host_platform_device_count={args.devices_per_process}"
  os.environ["XLA_FLAGS"] = xla_flags
  os.environ["JAX_PLATFORMS"] = "cpu"
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

  import jax  # after XLA_FLAGS: the CPU client reads them when it is created

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.num_processes > 1:
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id)

  # tests.conftest appends its own device count (8) to XLA_FLAGS at import; the backend is not created
  # yet, so put ours back before anything touches a device.
  from tests.fixtures import Batches, tiny_config
  os.environ["XLA_FLAGS"] = xla_flags

  import jaxtrain
  from jaxtrain import data, parallel

  assert jax.process_count() == args.num_processes, jax.process_count()
  assert jax.process_index() == args.process_id, jax.process_index()
  assert jax.local_device_count() == args.devices_per_process, jax.local_devices()
  assert jax.device_count() == args.num_processes * args.devices_per_process, jax.devices()

  overrides = json.loads(args.overrides)
  train = {**TRAIN, "steps": int(os.environ.get("JT_STEPS", TRAIN["steps"])), **overrides.pop("train", {})}
  cfg = tiny_config(**{**overrides, "train": train, "mesh": overrides.get("mesh", MESH)})
  t = cfg.train
  # The rows of the global batch this process builds, as train() builds them (same mesh, same sharding).
  mesh = parallel.make_mesh(cfg.mesh)
  rows = {split: Batches(data.make_source(cfg, split), t.batch_size, parallel.batch_sharding(mesh))
          for split in ("train", "eval")}

  if os.environ.get("JT_BREAK_SAVES") and args.process_id == 0:
    break_saves({int(s) for s in os.environ["JT_BREAK_SAVES"].split(",")}, cfg.checkpoint.dir)
  final = jaxtrain.train(cfg, args.workdir, progress=False, sync_every_step=True)

  report = {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "local_devices": jax.local_device_count(),
      "global_devices": jax.device_count(),
      "rows": {split: [b.feed.lo, b.feed.hi] for split, b in rows.items()},
      "batch_size": t.batch_size,
      # mesh axis 0 is replica: the processes holding each replica's devices
      "replica_processes": [sorted({d.process_index for d in r.flat}) for r in mesh.devices],
      "final": {k: v for k, v in final.items() if isinstance(v, (int, float, str))},
  }
  os.makedirs(args.workdir, exist_ok=True)
  with open(os.path.join(args.workdir, f"process_{args.process_id}.json"), "w") as f:
    json.dump(report, f, indent=2)

  if args.num_processes > 1:
    jax.distributed.shutdown()


def break_saves(steps: set, directory: str):
  """Checkpoints.save of those steps runs with `directory`'s parent replaced by a file."""
  from jaxtrain import checkpoint
  real, parent = checkpoint.Checkpoints.save, os.path.dirname(directory)

  def save(ckpts, step, *a, **k):
    if step not in steps:
      return real(ckpts, step, *a, **k)
    ckpts.wait()
    os.rename(parent, parent + ".away")
    open(parent, "w").close()
    try:
      return real(ckpts, step, *a, **k)
    finally:
      os.remove(parent)
      os.rename(parent + ".away", parent)
  checkpoint.Checkpoints.save = save


if __name__ == "__main__":
  main(parse_args())
