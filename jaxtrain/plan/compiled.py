"""The reference the planner is checked against: a config's train step compiled exactly as the loop
compiles it (`builder.compile_steps`, same mesh and rules) on abstract state and batch, and XLA's
own memory figures for it.

Per device: argument + output + temp - alias bytes of `Compiled.memory_analysis()` (the donated
state's outputs alias its inputs, so it counts once). Used by `train.batch_size=auto` to confirm its
choice and by the tests; the planner itself never compiles."""

import time

import jax

from jaxtrain import builder, parallel
from jaxtrain.core import state as state_lib


# LLVM's optimizations off: the same buffer assignment (an HLO-level decision), in about half the
# compile time
QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiled_memory(cfg, devices=None, quick: bool = False) -> dict:
  """Per-device bytes of the compiled train step of `cfg`: argument, output, alias, temp and total
  (argument + output + temp - alias). `quick` compiles with QUICK (for tests; the same figures)."""
  train_fn, state, batch, mesh = builder.abstract_step(cfg, devices)
  with parallel.activate(mesh, cfg.mesh.rules):
    lowered = train_fn.lower(state, batch)
    compiled = lowered.compile(compiler_options=QUICK) if quick else lowered.compile()
    stats = compiled.memory_analysis()
  out = {k: int(getattr(stats, f"{k}_size_in_bytes"))
         for k in ("argument", "output", "alias", "temp")}
  out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def step_timer(cfg, devices=None):
  """A function `steps -> seconds`: the wall time of the fastest of `steps` train steps of `cfg`, on
  real arrays: the step as the loop compiles it, the state born sharded, one real batch (fed once,
  reused), compiled and warmed up once here. The fastest, like the CPU peak it is compared with
  (metrics.peak_flops: the fastest of its repeats): other processes on a shared host only ever slow
  a step down, and a median taken under load measured the load."""
  devices = jax.devices() if devices is None else devices
  mesh, task, tx, schedule = builder.build(cfg, "", devices)
  feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
  batch = feed.put(next(task.batches("train", feed.lo, feed.hi)))
  state, shardings = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
  with parallel.activate(mesh, cfg.mesh.rules):
    train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)

  def fastest(steps: int) -> float:
    nonlocal state
    times = []
    with parallel.activate(mesh, cfg.mesh.rules):
      for _ in range(steps):
        start = time.perf_counter()
        state, out = train_fn(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return min(times)

  fastest(1)  # the warm-up step
  return fastest


def measured_step_time(cfg, steps: int = 5, devices=None) -> float:
  """Wall time (seconds) of the fastest of `steps` train steps of `cfg` after a warm-up step
  (step_timer)."""
  return step_timer(cfg, devices)(steps)
