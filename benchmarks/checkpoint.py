"""Checkpoint cost against the train step and the disk, side by side in one run.

  python benchmarks/checkpoint.py [--config small_20m] [--saves 3] [--dir DIR] [--record]

For the config's full train state (params + AdamW moments): the median train-step time; the loop's
blocking time per asynchronous save (Checkpoints.save, the loop's own call, after the step finished);
the save's bytes and end-to-end write throughput (until Orbax finalized the step); restore time and
throughput (Checkpoints.restore into the same shardings); and, in the same directory, the disk's
sequential write speed (the same number of bytes in 64 MiB chunks, then fsync) and read speed.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.train_step import machine_lines, publish  # noqa: E402
from jaxtrain import checkpoint, config as config_lib, data, parallel  # noqa: E402
from jaxtrain.train import loop, state as state_lib  # noqa: E402

CHUNK = 64 << 20


def disk_speed(directory: str, nbytes: int) -> tuple[float, float]:
  """Sequential write (fsync'd) and read bytes/s of one file of `nbytes` in `directory`."""
  path = os.path.join(directory, "disk_probe.bin")
  block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
  start = time.perf_counter()
  with open(path, "wb") as f:
    for _ in range(max(1, nbytes // CHUNK)):
      f.write(block)
    f.flush()
    os.fsync(f.fileno())
  write = max(1, nbytes // CHUNK) * CHUNK / (time.perf_counter() - start)
  start = time.perf_counter()
  with open(path, "rb") as f:
    while f.read(CHUNK):
      pass
  read = max(1, nbytes // CHUNK) * CHUNK / (time.perf_counter() - start)
  os.remove(path)
  return write, read


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="small_20m")
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args()

  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", f"{args.config}.py"))
  cfg.mesh.update(data=1, fsdp=1, expert=1, tensor=1)
  root = tempfile.mkdtemp(dir=args.dir or None)
  cfg.checkpoint.update(dir=os.path.join(root, "checkpoints"), keep=args.saves + 1)
  devices = jax.devices()[:1]
  mesh, model, tx, schedule = loop.build(cfg, devices)
  state, shardings = state_lib.create_state(model, tx, cfg.train.seq_len, 0, mesh, cfg.mesh.rules)
  batches = loop.Batches(data.make_source(cfg, "train"), cfg.train.batch_size, cfg.train.seq_len,
                         parallel.batch_sharding(mesh))
  ckpts = checkpoint.Checkpoints(cfg, root)
  blocking, total, step_times = [], [], []
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.RULES[cfg.mesh.rules]):
    train_fn, _ = loop.compile_steps(cfg, mesh, model, tx, schedule, shardings)
    state, m = train_fn(state, batches(0))  # compile
    jax.block_until_ready(m)
    for i in range(args.saves):
      for j in range(args.steps):
        start = time.perf_counter()
        state, m = train_fn(state, batches(1 + i * args.steps + j))
        jax.block_until_ready(m)
        step_times.append(time.perf_counter() - start)
      ckpts.save(int(state.step), state, {"index": i}, {"config": cfg.to_dict(), "tokenizer": None},
                 ckpts.persistent())
      ckpts.wait()
      record = ckpts.finished_saves()[0]
      blocking.append(record.blocking_s)
      total.append(record.finished - record.started)
  nbytes = record.bytes
  restore_times = []
  abstract = jax.eval_shape(state_lib.init_fn(model, tx, cfg.train.seq_len), 0)
  for _ in range(args.saves):
    restored, _, _, row = ckpts.restore(abstract, shardings)
    restore_times.append(row["restore_s"])
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
  ckpts.close()
  write_speed, read_speed = disk_speed(root, nbytes)
  shutil.rmtree(root)

  step, block, save, load = (float(np.median(x)) for x in (step_times, blocking, total, restore_times))
  lines = [
      f"### Checkpoint cost vs train step and disk ({time.strftime('%Y-%m-%d')})",
      "",
      *machine_lines(),
      f"- command: `python benchmarks/checkpoint.py --config {args.config} --saves {args.saves}"
      f"{' --dir ' + args.dir if args.dir else ''}`",
      f"- state: {args.config}, params + AdamW moments, {nbytes / 1e6:.0f} MB float32, one device; "
      f"medians of {args.saves} saves/restores and {len(step_times)} steps",
      "",
      "| train step | save blocking | blocking / step | save end-to-end | save MB/s | disk write MB/s (fsync) "
      "| save / disk | restore | restore MB/s | disk read MB/s | restore / disk |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
      f"| {step * 1e3:.0f} ms | {block * 1e3:.0f} ms | {block / step:.1%} | {save * 1e3:.0f} ms "
      f"| {nbytes / save / 1e6:,.0f} | {write_speed / 1e6:,.0f} | {nbytes / save / write_speed:.0%} "
      f"| {load * 1e3:.0f} ms | {nbytes / load / 1e6:,.0f} | {read_speed / 1e6:,.0f} | {nbytes / load / read_speed:.0%} |",
  ]
  publish(lines, args.record)


if __name__ == "__main__":
  main()
