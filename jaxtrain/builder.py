"""Building a run: a validated config -> mesh, task, optimizer and schedule -> state shardings ->
jitted steps.

The loop (train/loop.py), the planner (plan/), `comm`, the benchmarks and the experiments all build
here, so the step they measure is the step the loop trains. Nothing here runs a step or writes a
file.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain import checkpoint, config as config_lib, optim, parallel
from jaxtrain.core import lora, offload, state as state_lib
from jaxtrain.core.lm import LanguageModel
from jaxtrain.core.mlm import MaskedLanguageModel
from jaxtrain.core.step import make_train_step
from jaxtrain.core.vlm import VisionLanguage
from jaxtrain.optim.diloco import call_position
from jaxtrain.posttrain import Dpo, Grpo, Ppo, RewardModel, Sft

# train.task -> the task it trains: the one list of tasks (a task written elsewhere: task=).
TASKS = {"lm": LanguageModel, "mlm": MaskedLanguageModel, "vlm": VisionLanguage, "sft": Sft,
         "rm": RewardModel, "dpo": Dpo, "grpo": Grpo, "ppo": Ppo}


class Run(NamedTuple):
  """What a config builds before any state exists."""
  mesh: Mesh
  task: object
  tx: optax.GradientTransformation
  schedule: optax.Schedule


def build(cfg, workdir: str = "", devices=None, task=None) -> Run:
  """Mesh, task (default: the one train.task names), optimizer and schedule of a validated
  config."""
  mesh = parallel.make_mesh(cfg.mesh, devices)
  check_offload(cfg.train.offload, mesh.devices.flat[0].platform)
  task = make_task(cfg, workdir) if task is None else task
  tx, schedule = optim.build(cfg.optim, cfg.train.steps, cfg.comm, cfg.diloco,
                             mesh.shape[cfg.comm.axis], cfg.train.seed)
  return Run(mesh, task, tx, schedule)


def check_offload(offload: str, platform: str) -> None:
  """train.offload on the devices' platform, refused in one line where it does not work: XLA:CPU
  executes no memory kinds, and XLA:GPU (jax 0.10.2) compiles params in pinned host memory but
  keeps them on the device (benchmarks/RESULTS.md, "Host offload")."""
  if offload != "none" and platform == "cpu":
    raise config_lib.ConfigError(
        f"train.offload={offload}: host offload needs a TPU or GPU (the CPU backend executes no "
        f"memory kinds); compile it for one with `python -m jaxtrain compile --target=...`")
  if offload == "params" and platform in ("gpu", "cuda", "rocm"):
    raise config_lib.ConfigError(
        "train.offload=params: XLA:GPU keeps the params in device memory (none reach the host); "
        "offload the optimizer or activations there")


def make_task(cfg, workdir: str):
  """The task train.task names (TASKS), trained through adapters with model.lora_rank > 0."""
  name = cfg.train.task
  if name not in TASKS:
    raise config_lib.ConfigError(
        f"train.task={name!r}: choose one of {', '.join(TASKS)} (or pass task=)")
  task = TASKS[name](cfg, workdir)
  return lora.Lora(task, cfg, newest_step) if cfg.model.lora_rank else task


def newest_step(path: str) -> int:
  """The newest complete step of a run or converted model (one ConfigError line when none)."""
  from jaxtrain.checkpoint import pretrained
  return pretrained.find_step(path)[1]


def train_step(cfg, task, tx, schedule, shardings):
  """`step(state, batch) -> (state, metrics)`, not jitted: the one optimizer step every program
  below runs."""
  way = optim.outer(cfg)
  step = make_train_step(task.loss, offload.around_tx(tx, cfg.train.offload), schedule,
                         metrics_fn=task.metrics, update_extra=task.update_extra,
                         microbatches=cfg.train.microbatches, reduce_axis=way.axis,
                         state_specs=manual_specs(shardings, way.axis),
                         local_metrics=way.local_metrics, loss_params=way.loss_params)
  return offload.around(step, cfg.train.offload)


def compile_steps(cfg, mesh, task, tx, schedule, shardings):
  """The train and eval steps, jitted once with explicit shardings; the state is donated."""
  batch_sh = parallel.batch_sharding(mesh)
  train_fn = jax.jit(train_step(cfg, task, tx, schedule, shardings),
                     in_shardings=(shardings, batch_sh), out_shardings=(shardings, None),
                     donate_argnums=0)
  eval_fn = jax.jit(
      offload.around_eval(task.eval_sums, cfg.train.offload),
      in_shardings=(shardings.params, shardings.extra, shardings.task_state, batch_sh))
  return train_fn, eval_fn


def compile_call(cfg, mesh, task, tx, schedule, shardings):
  """Several optimizer steps in one program (train.steps_per_call): `(state, batches) -> (state,
  metrics)` over the batches' leading axis (one entry per step, as are the metrics'); bitwise the
  same steps one call each (tests/train/test_steps_per_call.py). A scan of the train step, or with
  `overlapped(cfg)` the steps traced one after another, each knowing its position (DiLoCo issues a
  fragment's sync outside any conditional, so the compiler may overlap its collective with the
  steps until the one that applies it). The state is donated."""
  step, k = train_step(cfg, task, tx, schedule, shardings), cfg.train.steps_per_call
  if not overlapped(cfg):
    call = lambda state, batches: jax.lax.scan(step, state, batches)
  else:
    def call(state, batches):
      metrics = []
      for i in range(k):
        with jax.named_scope(f"call_step_{i}"), call_position(i, k):
          state, step_metrics = step(state, jax.tree.map(lambda b: b[i], batches))
        metrics.append(step_metrics)
      return state, jax.tree.map(lambda *m: jnp.stack(m), *metrics)
  return jax.jit(call, in_shardings=(shardings, parallel.stacked(parallel.batch_sharding(mesh))),
                 out_shardings=(shardings, None), donate_argnums=0)


def overlapped(cfg) -> bool:
  """Whether calls of train.steps_per_call steps trace each step at its position: streaming DiLoCo
  with a delay (a sync applied `diloco.delay` steps after it is sent) whose sync period
  (inner_steps / fragments) divides the call. Such calls start at step counts divisible by their
  length (train/calls.py)."""
  d, k = cfg.diloco, cfg.train.steps_per_call
  return bool(k > 1 and d.inner_steps and d.delay and k % (d.inner_steps // d.fragments) == 0)


def manual_specs(shardings, axis: str):
  """The shard_map specs of the state for a step manual over `axis`: a leaf laid on `axis` (a
  per-shard optimizer buffer) enters as its own shard, everything else whole."""
  def spec(sharding):
    keep = lambda e: e if e == axis or (isinstance(e, tuple) and axis in e) else None
    return P(*(keep(e) for e in sharding.spec))
  return jax.tree.map(spec, shardings)


def per_replica_metrics(cfg) -> bool:
  """Whether each replica's metrics come back (DiLoCo's inner steps send nothing over comm.axis)."""
  return optim.outer(cfg).local_metrics


def restore_state(ckpts: checkpoint.Checkpoints, task, tx, mesh, rules_name, step=None,
                  offload: str = "none"):
  """The newest (or `step`) checkpoint read straight into its shardings (nothing initialized first;
  `offload`: train.offload): (state, shardings, data_state, restore metrics row). What checkpoints
  leave out (a LoRA run's frozen base) is read again from its source."""
  shardings = state_lib.state_shardings(task, tx, mesh, rules_name, offload)
  state, data_state, _, row = ckpts.restore(state_lib.abstract_state(task, tx), shardings, step)
  return lora.refill(state, shardings, init_params), shardings, data_state, row


def init_params(path: str, like, step: int | None = None):
  """The params of another run or a converted model (newest step, or `step`), placed like `like`
  (the fresh params: same tree, shapes and shardings); a mismatch is one ConfigError line."""
  from jaxtrain.checkpoint import pretrained
  try:
    _, loaded = pretrained.load_params(path, step)
  except (FileNotFoundError, ValueError) as e:
    raise config_lib.ConfigError(f"checkpoint.init_from={path}: {e}") from e
  want = jax.tree_util.tree_flatten_with_path(like)[0]
  got = dict(jax.tree_util.tree_flatten_with_path(loaded)[0])
  for key, leaf in want:
    if key not in got or tuple(got[key].shape) != tuple(leaf.shape):
      found = "missing" if key not in got else f"shape {tuple(got[key].shape)}"
      raise config_lib.ConfigError(
          f"checkpoint.init_from={path}: {jax.tree_util.keystr(key)} is {found}, "
          f"the model needs {tuple(leaf.shape)}")
  return jax.tree_util.tree_map_with_path(
      lambda key, leaf: jax.make_array_from_callback(
          leaf.shape, leaf.sharding, lambda index: np.asarray(got[key][index], leaf.dtype)), like)


def abstract_step(cfg, devices=None, call: bool = False):
  """(jitted train step, abstract state, abstract batch, mesh) of a validated `cfg`, allocating
  nothing: what `comm` counts bytes in and what the planner is checked against. With `call`, the
  call of train.steps_per_call steps (compile_call) and its batches instead. Lower it inside
  `parallel.activate(mesh, cfg.mesh.rules)`."""
  devices = jax.devices() if devices is None else devices
  mesh, task, tx, schedule = build(cfg, "", devices)
  batch_sh = parallel.batch_sharding(mesh)
  feed = parallel.Feed(task.batch_size, batch_sh)
  try:
    host = next(task.batches("train", feed.lo, feed.hi))  # the shapes and dtypes of one batch
  except (FileNotFoundError, ValueError) as e:  # a text corpus not prepared
    raise config_lib.ConfigError(str(e)) from e
  batch = {
      k: jax.ShapeDtypeStruct((task.batch_size, *np.shape(v)[1:]),
                              np.asarray(v).dtype, sharding=batch_sh)
      for k, v in host.items()
  }
  shardings = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules, cfg.train.offload)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       state_lib.abstract_state(task, tx), shardings)
  with parallel.activate(mesh, cfg.mesh.rules):
    if not call:
      return compile_steps(cfg, mesh, task, tx, schedule, shardings)[0], state, batch, mesh
    k = cfg.train.steps_per_call
    stacked = parallel.stacked(batch_sh)
    batches = {name: jax.ShapeDtypeStruct((k, *b.shape), b.dtype, sharding=stacked)
               for name, b in batch.items()}
    return compile_call(cfg, mesh, task, tx, schedule, shardings), state, batches, mesh
