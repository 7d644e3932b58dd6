"""Checkpoint cost against the train step and the disk, side by side in one run.

  python benchmarks/checkpoint.py [--config small_20m] [--saves 3] [--dir DIR] [--record]

For the config's full train state (params + AdamW moments): the median train-step time; the loop's
blocking time per asynchronous save (Checkpoints.save, the loop's own call, after the step finished);
the save's bytes and end-to-end write throughput (until Orbax finalized the step); restore time and
throughput (Checkpoints.restore into the same shardings, from the disk: the files are fsync'd and
dropped from the page cache first); and, in the same directory and the same repeat, the disk's
sequential write speed (the same number of bytes in 64 MiB chunks, then fsync) and cold read speed.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.train_step import machine_lines, publish  # noqa: E402
from jaxtrain import checkpoint, config_files, data, parallel  # noqa: E402
from jaxtrain import builder  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402

CHUNK = 64 << 20


def evict(path: str) -> None:
  """Writes `path` (a file or every file below it) to disk and drops it from the page cache, so that
  the next read comes from the disk (posix_fadvise DONTNEED on clean pages needs no privileges)."""
  files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
  for name in files:
    fd = os.open(name, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def disk_write(directory: str, nbytes: int) -> tuple[float, str]:
  """Sequential write of `nbytes` in 64 MiB chunks, then fsync: bytes/s, and the file."""
  path = os.path.join(directory, "disk_probe.bin")
  block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
  n = max(1, nbytes // CHUNK)
  start = time.perf_counter()
  with open(path, "wb") as f:
    for _ in range(n):
      f.write(block)
    f.flush()
    os.fsync(f.fileno())
  return n * CHUNK / (time.perf_counter() - start), path


def disk_read(path: str) -> float:
  """Sequential read of a file evicted from the page cache first: bytes/s."""
  evict(path)
  start = time.perf_counter()
  with open(path, "rb") as f:
    while f.read(CHUNK):
      pass
  speed = os.path.getsize(path) / (time.perf_counter() - start)
  os.remove(path)
  return speed


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="small_20m")
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
  parser.add_argument("--batch_size", type=int, default=0, help="override train.batch_size (0: the config's)")
  parser.add_argument("--no_ocdbt", action="store_true", help="checkpoint.ocdbt=False (a zarr3 dir per array)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()

  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{args.config}.py"))
  cfg.mesh.update(data=1, fsdp=1, expert=1, tensor=1)
  if args.batch_size:
    cfg.train.batch_size = args.batch_size
  root = tempfile.mkdtemp(dir=args.dir or None)
  cfg.checkpoint.update(dir=os.path.join(root, "checkpoints"), keep=args.saves + 1, ocdbt=not args.no_ocdbt)
  devices = jax.devices()[:1]
  mesh, task, tx, schedule = builder.build(cfg, root, devices)
  state, shardings = state_lib.create_state(task, tx, 0, mesh, cfg.mesh.rules)
  feed, source = parallel.Feed(cfg.train.batch_size, parallel.batch_sharding(mesh)), data.make_source(cfg, "train")
  batches = lambda index: feed.batch(source, index)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, root)
  abstract = state_lib.abstract_state(task, tx)
  rows = []  # per repeat: step, blocking, save end-to-end, disk write, restore, disk read (seconds, bytes/s)
  with parallel.activate(mesh, cfg.mesh.rules):
    train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
    state, m = train_fn(state, batches(0))  # compile
    jax.block_until_ready(m)
    for i in range(args.saves):
      step_times = []
      for j in range(args.steps):
        start = time.perf_counter()
        state, m = train_fn(state, batches(1 + i * args.steps + j))
        jax.block_until_ready(m)
        step_times.append(time.perf_counter() - start)
      ckpts.save(int(state.step), state, {"index": i}, {"config": cfg.to_dict(), "tokenizer": None},
                 ckpts.persistent())
      ckpts.wait()
      record = ckpts.finished_saves()[0]
      nbytes = record.bytes
      write_speed, probe = disk_write(root, nbytes)
      read_speed = disk_read(probe)
      evict(os.path.join(root, "checkpoints"))  # the restore reads from the disk too
      restored, _, _, row = ckpts.restore(abstract, shardings)
      rows.append((float(np.median(step_times)), record.blocking_s, record.finished - record.started, write_speed,
                   row["restore_s"], read_speed))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
  ckpts.close()
  shutil.rmtree(root)

  r = np.asarray(rows)
  med = lambda x: float(np.median(x))  # noqa: E731
  step, block, save, write_speed, load, read_speed = (med(r[:, i]) for i in range(6))
  save_ratio, load_ratio = med(nbytes / r[:, 2] / r[:, 3]), med(nbytes / r[:, 4] / r[:, 5])
  lines = [
      f"### Checkpoint cost vs train step and disk ({time.strftime('%Y-%m-%d')})",
      "",
      *machine_lines(),
      f"- command: `python benchmarks/checkpoint.py --config {args.config} --saves {args.saves}"
      f"{' --dir ' + args.dir if args.dir else ''}{' --no_ocdbt' if args.no_ocdbt else ''}"
      f"{f' --batch_size {args.batch_size}' if args.batch_size else ''}`",
      f"- state: {args.config}, params + AdamW moments, {nbytes / 1e6:.0f} MB float32, one device, "
      f"{'zarr3 per array' if args.no_ocdbt else 'OCDBT'}, uncompressed; {args.saves} repeats of: "
      f"{args.steps} steps, an async save (the loop's call), a {nbytes / 1e6:.0f} MB fsync'd write probe, a "
      "cold read probe, a cold restore (files fsync'd and evicted from the page cache first); medians, "
      "ratios per repeat",
      "",
      "| train step | save blocking | blocking / step | save end-to-end | save MB/s | disk write MB/s "
      "| save / disk | restore (cold) | restore MB/s | disk read MB/s (cold) | restore / disk |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
      f"| {step * 1e3:.0f} ms | {block * 1e3:.0f} ms | {block / step:.1%} | {save * 1e3:.0f} ms "
      f"| {nbytes / save / 1e6:,.0f} | {write_speed / 1e6:,.0f} | {save_ratio:.0%} "
      f"| {load * 1e3:.0f} ms | {nbytes / load / 1e6:,.0f} | {read_speed / 1e6:,.0f} | {load_ratio:.0%} |",
  ]
  publish(lines, args.record)


if __name__ == "__main__":
  main()
