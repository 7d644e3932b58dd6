"""Steps per call: tokens/s of a config's train step run one step per jitted call against K steps per call
(train.steps_per_call: a scan over K batches fed together, builder.compile_call), side by side.

Each mode is built and compiled once on the same devices from the same initial state, with its batches
placed once (the host's data reading is left out: what is measured is the program and its dispatch). Then
`--rounds` rounds each time every mode over the same `--steps` optimizer steps, the modes in turn (the
order rotating by round), and the medians of their tokens/s and of their ratio to one step per call are
printed. Results: benchmarks/RESULTS.md, "Steps per call".

  python benchmarks/steps_per_call.py [--config tiny] [--devices 1] [--calls 1,4,16] [--steps 48] [--rounds 7]
  [--config.X=V ...]
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="tiny")
  p.add_argument("--devices", type=int, default=1, help="virtual CPU devices (the data axis)")
  p.add_argument("--calls", default="1,4,16", help="steps per call, compared with the first")
  p.add_argument("--steps", type=int, default=48, help="optimizer steps per mode and round")
  p.add_argument("--rounds", type=int, default=7)
  args, overrides = p.parse_known_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)
  import jax
  from jaxtrain import builder, config_files, parallel
  from jaxtrain.core import state as state_lib

  cfg = config_files.load_config_file(f"{ROOT}/configs/{args.config}.py")
  cfg = config_files.apply_overrides(cfg, dict(o[len("--config."):].split("=", 1) for o in overrides))
  ks = [int(k) for k in args.calls.split(",")]
  if any(args.steps % k for k in ks):
    sys.exit(f"--steps={args.steps} must be a multiple of every --calls entry")
  devices = jax.devices()[:args.devices]
  mesh, task, tx, schedule = builder.build(cfg, "", devices)
  feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
  source = task.batches("train", feed.lo, feed.hi)
  rows = [next(source) for _ in range(max(ks))]
  modes = {}
  with parallel.activate(mesh, cfg.mesh.rules):
    for k in ks:
      state, shardings = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
      if k == 1:
        fn, batch = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)[0], feed.put(rows[0])
      else:
        fn, batch = builder.compile_call(cfg, mesh, task, tx, schedule, shardings), feed.put_many(rows[:k])
      compiled = fn.lower(state, batch).compile()
      state, out = compiled(state, batch)  # warm-up
      jax.block_until_ready(out)
      modes[k] = [compiled, state, batch]

    def timed(k):
      compiled, state, batch = modes[k]
      start = time.perf_counter()
      for _ in range(args.steps // k):
        state, out = compiled(state, batch)
      jax.block_until_ready((state, out))
      modes[k][1] = state
      return task.tokens_per_batch * args.steps / (time.perf_counter() - start)

    rates = {k: [] for k in ks}
    for r in range(args.rounds):
      for k in ks[r % len(ks):] + ks[:r % len(ks)]:
        rates[k].append(timed(k))
  base = ks[0]
  print(f"{args.config} on {args.devices} CPU device(s), {args.steps} steps a mode and round, "
        f"{args.rounds} rounds, jax {jax.__version__}")
  print(f"| steps per call | tokens/s (median) | tokens/s (min-max) | vs {base} a call (median of rounds) |")
  print("|---|---|---|---|")
  for k in ks:
    ratio = statistics.median(a / b for a, b in zip(rates[k], rates[base]))
    print(f"| {k} | {statistics.median(rates[k]):,.0f} | {min(rates[k]):,.0f}-{max(rates[k]):,.0f} | "
          f"{ratio:.3f} |")


if __name__ == "__main__":
  main()
