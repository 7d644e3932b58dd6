"""Step time of compressed gradient reductions against the float32 data-parallel step (target <= 10%).

  python benchmarks/comm_overhead.py [--steps 10] [--rounds 7] [--only f32,int8] [--profile] [--record]

configs/tiny.py on 8 virtual CPU devices as replica=4 x data=2 (set here, before jax starts). Each
scheme's jitted train step is the loop's own (builder.build, state_lib.create_state,
builder.compile_steps), compiled and warmed up (3 steps) first; then `rounds` rounds, each timing
`steps` steps of every scheme
in turn, the order rotated each round (a slow spell of the shared machine hits every scheme alike). A
step is timed until its metrics are ready (jax.block_until_ready). Reported: per scheme the median over
rounds of its round median, and the median over rounds of the ratio to f32 DP's round median (with the
lowest and highest round). On CPU the collectives are memory copies between virtual devices: the ratio
measures the compute added by quantizing, not a network's time. `--record` appends to RESULTS.md.

`--profile` times the reduction alone, the same way (interleaved rounds, with the f32 train step), on
the same mesh and a random gradient with tiny's parameter shapes: the f32 psum; Layout's flatten +
unflatten of the tree; the compressed pipeline in format f32 (flatten, all-to-all, local sum,
all-gather, unflatten: no quantizer); per format, one encode + decode of the flat vector between
flatten and unflatten (no collective), the whole compressed reduction, and the same with the received
pieces added by unrolled adds rather than `.sum(axis=0)` (reduce_flat_unrolled, a candidate fix). Where
a compressed step's extra time goes: the tree <-> vector copies, the pipeline, the quantizers, or the
sum of the received pieces.
"""

import argparse
import datetime
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks.train_step import machine_lines, publish  # noqa: E402
from jaxtrain import config as config_lib, config_files, data, parallel  # noqa: E402
from jaxtrain import collectives  # noqa: E402
from jaxtrain.optim import compress, quantize  # noqa: E402
from jaxtrain import builder  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402

SCHEMES = {  # name -> comm overrides on tiny with optim.reduce_axis=replica
    "f32": {},
    "bf16": {"format": "bf16"},
    "fp8": {"format": "fp8"},
    "int8": {"format": "int8"},
    "int4": {"format": "int4"},
    "int4+ef": {"format": "int4", "error_feedback": "ef"},
}


def scheme_config(name: str):
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  cfg.mesh.update(replica=4, data=2)
  cfg.optim.reduce_axis = "replica"
  cfg.comm.update(SCHEMES[name])
  return cfg


class MeshStepper:
  """`cfg`'s jitted train step (the loop's own) on every device of its mesh, compiled and warmed up;
  each `step()` takes the next batch and returns the seconds until its metrics are ready."""

  def __init__(self, cfg, warmup: int = 3):
    devices = jax.devices()
    config_lib.validate(cfg, len(devices))
    mesh, task, tx, schedule = builder.build(cfg, "", devices)
    self.state, shardings = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
    feed, source = parallel.Feed(cfg.train.batch_size, parallel.batch_sharding(mesh)), data.make_source(cfg, "train")
    self._batches = lambda index: feed.batch(source, index)
    self._mesh, self._rules = mesh, cfg.mesh.rules
    with parallel.activate(mesh, self._rules):
      self._train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
    self._next = 0
    for _ in range(warmup):
      self.step()

  def step(self) -> float:
    batch = self._batches(self._next)
    self._next += 1
    with parallel.activate(self._mesh, self._rules):
      t = time.perf_counter()
      self.state, step_metrics = self._train_fn(self.state, batch)
      jax.block_until_ready(step_metrics)  # the state's update is part of the same program
      return time.perf_counter() - t


def interleave(timers: dict, steps: int, rounds: int) -> dict:
  """{name: {"round_medians": [...], "ratios": [...]}}: each round times `steps` calls of every timer
  (a callable returning seconds), in an order rotated each round; ratios to the first timer's."""
  names = list(timers)
  medians = {name: [] for name in names}
  for i in range(rounds):
    for name in names[i % len(names):] + names[:i % len(names)]:
      medians[name].append(float(np.median([timers[name]() for _ in range(steps)])))
    print(f"round {i + 1}: " + ", ".join(f"{n} {medians[n][-1] * 1e3:.1f} ms" for n in names), flush=True)
  base = medians[names[0]]
  return {n: {"round_medians": m, "ratios": [a / b for a, b in zip(m, base)]} for n, m in medians.items()}


def measure(names: list[str], steps: int, rounds: int) -> dict:
  """Each scheme's train step, interleaved (see the docstring)."""
  steppers = {}
  for name in names:
    steppers[name] = MeshStepper(scheme_config(name))
    print(f"compiled {name}", flush=True)
  return interleave({name: stepper.step for name, stepper in steppers.items()}, steps, rounds)


def reduce_flat_unrolled(x, axis: str, fmt: str, block: int):
  """compress.reduce_flat's sum (no feedback), with the G received pieces added by G - 1 unrolled adds
  instead of `.sum(axis=0)`: a candidate fix measured by --profile, not what jaxtrain runs."""
  shards = collectives.axis_size(axis)
  scale = quantize.fp8_scale(collectives.pmax(jnp.max(jnp.abs(x)), (axis,))) if fmt == "fp8" else None
  payload, scales = quantize.encode(x.reshape(shards, -1), fmt, block, scale)
  received = collectives.all_to_all(payload, axis, 0)
  if quantize.has_block_scales(fmt):
    scales = collectives.all_to_all(scales, axis, 0)
  pieces = quantize.decode(received, scales, fmt, block)
  owned = pieces[0]
  for i in range(1, shards):
    owned = owned + pieces[i]
  payload, scales = quantize.encode(owned, fmt, block, None if scale is None else scale * shards)
  payload = collectives.all_gather(payload, axis)
  if quantize.has_block_scales(fmt):
    scales = collectives.all_gather(scales, axis)
  return quantize.decode(payload, scales, fmt, block)


def reduction_timers(formats: list[str]) -> dict:
  """Jitted reductions of a random per-replica gradient (tiny's parameter shapes, replica=4 x data=2):
  name -> callable returning the seconds of one call."""
  cfg = scheme_config("f32")
  devices = jax.devices()
  mesh, task, tx, _ = builder.build(cfg, "", devices)
  shards = mesh.shape["replica"]
  shapes = state_lib.abstract_state(task, tx).params
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes))))
  sharding = NamedSharding(mesh, P("replica"))
  grads = jax.tree.map(lambda s: jax.device_put(1e-3 * jax.random.normal(next(keys), (shards, *s.shape)), sharding),
                       shapes)

  def timer(body):
    def per_replica(g):
      return jax.tree.map(lambda x: x[None], body(jax.tree.map(lambda x: x[0], g)))
    with jax.set_mesh(mesh):
      fn = jax.jit(collectives.shard_map(per_replica, ("replica",), in_specs=P("replica"), out_specs=P("replica")))
      compiled = fn.lower(grads).compile()
    jax.block_until_ready(compiled(grads))

    def run():
      t = time.perf_counter()
      jax.block_until_ready(compiled(grads))
      return time.perf_counter() - t
    return run

  def layout(g, fmt=None):
    """flatten -> [encode -> decode] -> unflatten; the barrier keeps XLA from folding slice(concat) away."""
    lay = compress.Layout(g, compress.multiple("int8", shards, cfg.comm.block))
    x = jax.lax.optimization_barrier(lay.flatten(g))
    if fmt:
      scale = quantize.fp8_scale(jnp.max(jnp.abs(x))) if fmt == "fp8" else None
      x = quantize.roundtrip(x.reshape(shards, -1), fmt, cfg.comm.block, scale).reshape(-1)
    return lay.unflatten(x)

  def unrolled(g, fmt):
    lay = compress.Layout(g, compress.multiple(fmt, shards, cfg.comm.block))
    return lay.unflatten(reduce_flat_unrolled(lay.flatten(g), "replica", fmt, cfg.comm.block))

  def compressed(fmt):
    sum_tx = compress.compressed_sum("replica", shards, fmt, cfg.comm.block)
    return lambda g: sum_tx.update(g, sum_tx.init(g))[0]

  timers = {"f32 psum (the DP reduction)": timer(lambda g: collectives.psum(g, ("replica",))),
            "flatten + unflatten (Layout)": timer(layout),
            "compressed pipeline in f32 (no quantizer)": timer(compressed("f32"))}
  for fmt in formats:
    timers[f"{fmt}: flatten + encode + decode + unflatten, no collective"] = timer(lambda g, f=fmt: layout(g, f))
    timers[f"{fmt}: whole compressed reduction"] = timer(compressed(fmt))
    timers[f"{fmt}: whole, pieces summed by unrolled adds"] = timer(lambda g, f=fmt: unrolled(g, f))
  return timers


def profile(steps: int, rounds: int) -> list[str]:
  """Table lines: each reduction's time against the f32 psum and against the f32 train step, measured
  interleaved with the step itself."""
  timers = {"f32 train step": MeshStepper(scheme_config("f32")).step}
  timers.update(reduction_timers(["bf16", "fp8", "int8", "int4"]))
  results = interleave(timers, steps, rounds)
  step = results.pop("f32 train step")["round_medians"]
  psum = results["f32 psum (the DP reduction)"]["round_medians"]
  lines = ["| reduction alone (jitted, replica=4 x data=2) | median of rounds | vs f32 psum | share of the f32 step |",
           "|---|---:|---:|---:|"]
  for name, r in results.items():
    m = r["round_medians"]
    lines.append(f"| {name} | {np.median(m) * 1e3:.1f} ms | {np.median([a / b for a, b in zip(m, psum)]):.2f}x | "
                 f"{np.median([a / b for a, b in zip(m, step)]):.1%} |")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10, help="timed steps per scheme per round")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--only", default="", help="comma-separated schemes; f32 is always first")
  parser.add_argument("--profile", action="store_true", help="time the reduction's parts instead (docstring)")
  parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
  args = parser.parse_args()
  names = ["f32"] + [n for n in (args.only.split(",") if args.only else SCHEMES) if n != "f32"]
  if args.profile:
    lines = [f"### Compressed gradient reduction: where the time goes ({datetime.date.today()})", "",
             *machine_lines(),
             f"- command: `python benchmarks/comm_overhead.py --profile --steps {args.steps} --rounds {args.rounds}`",
             "- a random gradient with configs/tiny.py's parameter shapes (426,624), one per replica, on 8 virtual "
             f"CPU devices as replica=4 x data=2; each reduction jitted alone; {args.rounds} rounds x {args.steps} "
             "calls, interleaved with the f32 train step", "",
             *profile(args.steps, args.rounds)]
    publish(lines, args.record)
    return
  results = measure(names, args.steps, args.rounds)
  lines = [
      f"### Compressed gradient reduction: step time vs f32 data parallelism ({datetime.date.today()})", "",
      *machine_lines(),
      f"- command: `python benchmarks/comm_overhead.py --steps {args.steps} --rounds {args.rounds}"
      f"{f' --only {args.only}' if args.only else ''}`",
      f"- configs/tiny.py, 8 virtual CPU devices as replica=4 x data=2, optim.reduce_axis=replica, comm.block 256; "
      f"the loop's jitted step, 3 warm-up steps, then {args.rounds} rounds x {args.steps} steps per scheme, schemes "
      "in rotating order each round; ratio = median over rounds of (scheme's round median / f32's round median)",
      "- the collectives here are copies between virtual devices on 2 shared cores: the overhead is the "
      "compute of flattening, quantizing and dequantizing, not any network time (target <= 10%)", "",
      "| scheme | step (median of rounds) | vs f32 DP (median) | lowest, highest round | <= 1.10 |",
      "|---|---:|---:|---:|---|",
  ]
  for name, r in results.items():
    ratios = r["ratios"]
    ratio = float(np.median(ratios))
    lines.append(f"| {name} | {np.median(r['round_medians']) * 1e3:.0f} ms | {ratio:.3f} | "
                 f"{min(ratios):.3f}, {max(ratios):.3f} | {'yes' if ratio <= 1.10 else '**no**'} |")
  publish(lines, args.record)


if __name__ == "__main__":
  main()
