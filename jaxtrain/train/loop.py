"""The composition root: config -> task (data, model) -> mesh -> optimizer -> jitted step -> loop.

`train(cfg, workdir, task=None)` is the library entry point (language-model pre-training unless another
task is passed); the CLI only parses flags and calls it.
"""

import contextlib
import json
import os
import time

import jax
import numpy as np
import tqdm.auto
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint, config as config_lib, errors, metrics as metrics_lib, parallel
from jaxtrain.builder import build, compile_steps, init_params, per_replica_metrics, restore_state
from jaxtrain.core import state as state_lib
from jaxtrain.parallel import hlo_bytes
from jaxtrain.plan import auto
from jaxtrain.train import goodput as goodput_lib, lock, peers
from jaxtrain.train.preemption import Preemption
from jaxtrain.train.workdir import check_workdir, write_config

PROGRESS_INTERVAL_S = 1.0  # the progress bar redraws at most this often (notebooks keep every redraw)


def peak_flops_total(cfg) -> tuple[float, str]:
  """Peak FLOP/s of the whole job: per device on accelerators, per host on CPU (shared cores)."""
  peak, source = metrics_lib.peak_flops(cfg.model.compute_dtype)
  units = jax.process_count() if jax.default_backend() == "cpu" else jax.device_count()
  return peak * units, source


def comm_bytes(hlo_text: str, mesh) -> dict:
  """Bytes each device sends per optimizer step, from the compiled step: `comm_bytes` in all and
  `comm_bytes_<axis>` per mesh axis a collective spans (parallel/hlo_bytes.py)."""
  rows = hlo_bytes.collectives(hlo_text, mesh)
  out = {"comm_bytes": hlo_bytes.total(rows)}
  for (axes, _), n in hlo_bytes.by_axis(rows).items():
    out[f"comm_bytes_{axes}"] = out.get(f"comm_bytes_{axes}", 0.0) + n
  return out


def readable(mesh, per_replica: bool):
  """`metrics -> metrics` that this process can read on the host. Per-replica metrics lie on the replica
  axis, which may span processes (then no process can fetch them whole): there they are gathered,
  replicated, by a small program dispatched right behind the step, so the one-step-late read finds them
  ready on every process, which all take the same decisions from them. The step itself still sends
  nothing over the axis between syncs. One process, or metrics already reduced: nothing to do."""
  if not (per_replica and jax.process_count() > 1):
    return lambda step_metrics: step_metrics
  return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


def read_metrics(step_metrics, per_replica: bool) -> dict:
  """A step's metrics on the host; per-replica ones (a leading axis of one entry per replica) reduced:
  the worst for the skip counters, the mean for the rest."""
  values = jax.device_get(step_metrics)
  if not per_replica:
    return values
  worst = ("skipped_steps", "consecutive_skips")
  return {k: np.max(v, axis=0) if k in worst else np.mean(v, axis=0) for k, v in values.items()}


def evaluate(eval_fn, state, feed, task, n: int) -> dict:
  """The task's eval metrics over the first n batches of a fresh eval iterator (a fixed held-out set)."""
  batches = task.batches("eval", feed.lo, feed.hi)
  sums = [jax.device_get(eval_fn(state.params, state.extra, state.task_state, feed.put(local)))
          for _, local in zip(range(n), batches)]
  return task.eval_metrics(sums)


def checkpoint_meta(cfg, workdir: str) -> dict:
  """What a checkpoint carries beside the arrays: the config and the tokenizer reference."""
  ref = os.path.join(workdir, "tokenizer_ref.json")
  tokenizer = None
  if os.path.isfile(ref):
    with open(ref) as f:
      tokenizer = json.load(f)
  return {"config": cfg.to_dict(), "tokenizer": tokenizer}


class Log:
  """Rows of metrics.jsonl and the progress bar. A step's metrics are read one step late (after the
  next step was dispatched), so the loop never waits on the device for them."""

  def __init__(self, writer, bar, constants: dict, task, peak: float, per_replica: bool = False, goodput=None):
    self.writer, self.bar, self.constants, self.peak = writer, bar, constants, peak
    self.per_replica, self.goodput = per_replica, goodput  # goodput: step -> its cumulative columns, or None
    self.tokens, self.flops = task.tokens_per_batch, task.flops_per_token
    self.restart_window()

  def restart_window(self):
    self.window_start, self.window_steps = time.perf_counter(), 0

  def event(self, step: int, row: dict):
    self.writer.write(step, row)

  def step(self, pending) -> dict:
    """Logs a finished step's metrics (and its eval results) when due. Returns the row or {}."""
    step, step_metrics, due, extra = pending
    if not due:
      return {}
    values = {**{k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
                 for k, v in read_metrics(step_metrics, self.per_replica).items()}, **extra}
    step_time = (time.perf_counter() - self.window_start) / max(self.window_steps, 1)
    row = {**values, "step_time_s": step_time, **self.constants}
    if self.tokens:
      row.update(tokens_per_sec=self.tokens / step_time, mfu=self.flops * self.tokens / step_time / self.peak)
    if self.goodput is not None:
      row.update(self.goodput(step))
    self.writer.write(step, row)
    self.bar.update(step - self.bar.n)
    self.bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{row.get('tokens_per_sec', 0):,.0f}",
                         mfu=f"{row.get('mfu', 0):.1%}", refresh=False)
    self.restart_window()
    return row

  def health(self, step_metrics) -> dict:
    """The few scalars read every step: the save policy's warning signs and the divergence counter."""
    keys = ("loss", "grad_norm", "skipped_steps", "consecutive_skips")
    return {k: float(v) for k, v in read_metrics({k: step_metrics[k] for k in keys}, self.per_replica).items()}


def _rollback(cfg, ckpts, task, tx, mesh, step: int, rollbacks: int):
  """(state, step) of the last good checkpoint, or errors.Diverged when there is none or rollbacks ran out."""
  o = cfg.optim
  why = (f"training diverged: {o.max_consecutive_skips} non-finite updates in a row up to step {step} "
         f"(optim.max_consecutive_skips)")
  if o.on_divergence != "rollback":
    raise errors.Diverged(f"{why}; lower optim.lr, or set optim.on_divergence=rollback")
  ckpts.wait()
  good = ckpts.latest_good()  # the newest step saved while training was calm (adaptive tiers)
  good = ckpts.latest()[0] if good is None else good
  if good is None or rollbacks >= o.max_rollbacks:
    reason = "no checkpoint to roll back to" if good is None else f"{rollbacks} rollbacks already"
    raise errors.Diverged(f"{why}; {reason} (optim.max_rollbacks={o.max_rollbacks})")
  ckpts.delete_after(good)
  state = restore_state(ckpts, task, tx, mesh, cfg.mesh.rules, good)[0]
  return state, good


def train(cfg, workdir: str, *, task=None, devices=None, progress: bool = True, sync_every_step: bool = False,
          start_over: bool = False) -> dict:
  """Trains `task` (default: language modeling on `cfg.data` with `cfg.model`) in `workdir`, resuming from
  its newest checkpoint; returns the last logged metrics.

  `devices` defaults to all; `sync_every_step` blocks on each step (many virtual CPU devices on few
  cores have deadlocked XLA's collectives when steps were dispatched ahead); `start_over` deletes
  the workdir's checkpoints and logs (needed when they come from an incompatible config). Whatever
  happens, every sink and manager opened here is closed before it returns or raises. The workdir is
  locked for the run: a second run on it is refused (one line). Multi-process: a lost peer ends every
  survivor with one line and status 6 within ~1.2 x `train.peer_timeout_s` (train/peers.py)."""
  with peers.watch(cfg.train.peer_timeout_s), lock.hold(workdir):
    return _train(cfg, workdir, task, devices, progress, sync_every_step, start_over)


def _train(cfg, workdir, task, devices, progress, sync_every_step, start_over) -> dict:
  goodput = goodput_lib.Goodput()  # every interval from here on is charged to one of its buckets
  devices = jax.devices() if devices is None else devices
  cfg, auto_row = auto.resolve(cfg, devices)  # train.batch_size/microbatches=auto: chosen, compiled, confirmed
  config_lib.validate(cfg, len(devices))
  check_workdir(cfg, workdir, start_over)
  t, o = cfg.train, cfg.optim
  mesh, task, tx, schedule = build(cfg, workdir, devices, task)
  show = progress and jax.process_index() == 0

  with contextlib.ExitStack() as stack:
    goodput.energy = goodput_lib.gpu_energy_meter()  # None off NVIDIA GPUs or without nvidia-ml-py
    if goodput.energy is not None:
      stack.callback(goodput.energy.stop)
    # ---- data, opened before compiling: this process's rows of each global batch, with a state ----
    feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
    try:
      task.prepare(show)
      train_iter = task.batches("train", feed.lo, feed.hi)
      if t.eval_every:
        task.batches("eval", feed.lo, feed.hi)  # fails now, not at the first evaluation
    except (FileNotFoundError, ValueError) as e:  # a missing corpus, no usable documents
      raise config_lib.ConfigError(str(e)) from e
    constants, sizes = task.constants(), task.sizes()
    if show and sizes:
      print(f"model: {sizes['params']:,} parameters, {sizes['active_params']:,} active per token", flush=True)
    write_config(cfg, workdir)

    # ---- sinks and state: restored from the newest complete checkpoint of any tier, or born sharded ----
    writer = metrics_lib.MetricsWriter(workdir, enabled=jax.process_index() == 0)
    stack.callback(writer.close)
    if auto_row:
      writer.write(0, auto_row)
    ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir)
    stack.callback(ckpts.close)
    meta = checkpoint_meta(cfg, workdir)
    if ckpts.latest()[0] is not None:
      goodput.charge("init")
      state, shardings, data_state, row = restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)
      goodput.charge("restore")
      goodput.resume(goodput_lib.history(workdir), int(state.step))
      train_iter.set_state(data_state)
      writer.write(int(state.step), row)
    else:
      state, shardings = state_lib.create_state(task, tx, t.seed, mesh, cfg.mesh.rules)
      if cfg.checkpoint.init_from:
        params, task_state = task.init_from(state.params, state.task_state,
                                            lambda like: init_params(cfg.checkpoint.init_from, like))
        state = state.replace(params=params, task_state=task_state)
    start = int(state.step)
    goodput.charge("init")

    # ---- compile once, with the logical rules and mesh in context ----
    stack.enter_context(parallel.activate(mesh, cfg.mesh.rules))
    train_fn, eval_fn = compile_steps(cfg, mesh, task, tx, schedule, shardings)
    peak, peak_source = peak_flops_total(cfg)
    bar = stack.enter_context(tqdm.auto.tqdm(total=t.steps, initial=start, disable=not show, dynamic_ncols=True,
                                             mininterval=PROGRESS_INTERVAL_S))
    per_replica = per_replica_metrics(cfg)
    units = jax.process_count() if jax.default_backend() == "cpu" else jax.device_count()  # GPUs paid for
    log = Log(writer, bar, constants, task, peak, per_replica,
              lambda s: goodput.row(s, task.tokens_per_batch, t.gpu_hour_price, units))
    gather = readable(mesh, per_replica)
    last, pending, rollbacks, compiled = {}, None, 0, None
    goodput.charge("init")  # jitting, the peak FLOP/s probe

    # ---- loop: dispatch step n, then read step n-1's metrics; SIGTERM/SIGINT: save and stop ----
    preemption = stack.enter_context(Preemption())
    adaptive = any(tier.adaptive for tier in ckpts.tiers)
    step = start
    while step < t.steps:
      data_state = train_iter.get_state()
      try:
        local = next(train_iter)
        goodput.charge("data")
        batch = task.make_batch(state.params, state.extra, state.task_state, feed.put(local), step)
      except KeyboardInterrupt:  # Ctrl-C in host code without the handler (a second one, or a task's own)
        train_iter.set_state(data_state)  # the batch it was reading is the resumed run's first
        last["preempted"] = preemption.requested = "KeyboardInterrupt"
        pending = pending and (*pending[:2], True, pending[3])
        break
      if compiled is None:  # compiled once, here, so that its HLO says what the step sends (comm_bytes)
        goodput.charge("step")
        compiled = train_fn.lower(state, batch).compile()
        log.constants.update(comm_bytes(compiled.as_text(), mesh))
        goodput.charge("compile")
      state, step_metrics = compiled(state, batch)
      step_metrics = gather(step_metrics)
      if sync_every_step:
        jax.block_until_ready(step_metrics)
      if pending is not None:
        health = log.health(pending[1])  # the previous step's, read while this one runs
        if adaptive:
          _log_decisions(log, pending[0], ckpts.observe(pending[0], health["loss"], health["grad_norm"],
                                                        health["skipped_steps"]))
        if health["consecutive_skips"] >= o.max_consecutive_skips:
          log.step((*pending[:2], True, {}))
          goodput.charge("step", pending[0])
          state, step = _rollback(cfg, ckpts, task, tx, mesh, pending[0], rollbacks)  # or raises Diverged
          goodput.charge("restore")
          goodput.rewind(step, pending[0])
          rollbacks += 1
          log.event(step, {"event": "rollback", "from_step": pending[0], "rollbacks": rollbacks})
          pending = None
          log.restart_window()
          continue
        last = log.step(pending) or last
      log.window_steps += 1
      is_last = step + 1 == t.steps
      # The first step is always logged alone: its time includes compilation, later windows' do not.
      pending = (step + 1, step_metrics, is_last or step == start or (step + 1) % t.log_every == 0, {})
      if t.eval_every and ((step + 1) % t.eval_every == 0 or is_last):
        jax.block_until_ready(state)  # the step's own time stays in the step's window, the eval's does not
        goodput.charge("step", step + 1)
        eval_start = time.perf_counter()
        result = evaluate(eval_fn, state, feed, task, t.eval_batches)
        result["eval_time_s"] = time.perf_counter() - eval_start
        goodput.charge("eval")
        log.window_start += result["eval_time_s"]
        pending = (step + 1, step_metrics, True, result)  # logged in the same row as the step
        if show:
          shown = {k: v for k, v in result.items() if k != "eval_time_s"}
          bar.write(f"step {step + 1}: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items()))
      step += 1
      if preemption.check(step):
        pending = (*pending[:2], True, pending[3])
        last["preempted"] = preemption.requested
        break
      if not is_last and (due := ckpts.due(step)):
        jax.block_until_ready(state)  # the save waits for its step: that wait is the step's, the rest the save's
        goodput.charge("step", step)
        _log_decisions(log, step, ckpts.save(step, state, train_iter.get_state(), meta, due))
        goodput.charge("checkpoint")
      for record in ckpts.finished_saves():  # also where a failed background save is noticed
        log.event(record.step, record.row())
      ckpts.check()  # errors.SaveFailed after checkpoint.max_failed_saves failed saves of a tier in a row
      goodput.charge("step", step)
    if pending is not None:
      if log.health(pending[1])["consecutive_skips"] >= o.max_consecutive_skips:
        raise errors.Diverged(f"training diverged: the last {o.max_consecutive_skips} updates up to step "
                              f"{pending[0]} were not finite (optim.max_consecutive_skips); lower optim.lr")
      last.update(log.step(pending))

    # ---- the end (also after a preemption): a forced save to the persistent tier ----
    jax.block_until_ready(state)
    goodput.charge("step", int(state.step))
    ckpts.save(int(state.step), state, train_iter.get_state(), meta, ckpts.persistent())
    ckpts.wait()
    goodput.charge("checkpoint")
    for record in ckpts.finished_saves():
      log.event(record.step, record.row())
    ckpts.check(final=True)  # errors.SaveFailed when the final save failed
    totals = log.goodput(int(state.step))
    log.event(int(state.step), {"event": "goodput", **totals})
    if show:
      bar.write(goodput_lib.summary(totals))
  last.update({"peak_flops": peak, "peak_source": peak_source, "step": int(state.step), "rollbacks": rollbacks,
               **sizes, **constants, **totals})
  return last


def _log_decisions(log: Log, step: int, decisions: list[str]):
  for decision in decisions:
    log.event(step, {"event": "checkpoint_policy", "decision": decision})
