"""The composition root: config -> builder (mesh, task, optimizer, steps) -> state -> the loop.

`train(cfg, workdir, task=None)` is the library entry point (language-model pre-training unless
another task is passed); the CLI only parses flags and calls it. `_train` reads top to bottom in
phases (data, sinks and state, compile, loop, the end); the loop's own bookkeeping is one object,
`Loop`, whose methods are the phases of a step (batch, dispatch, read the previous step, evaluate,
stop, save).
"""

import contextlib
import json
import os
import time

import jax
import numpy as np
import tqdm.auto

from jaxtrain import checkpoint, config as config_lib, errors, metrics as metrics_lib, parallel
from jaxtrain.builder import (Run, build, compile_call, compile_steps, init_params,
                              per_replica_metrics, restore_state)
from jaxtrain.core import state as state_lib
from jaxtrain.plan import auto, oom
from jaxtrain.train import (calls, goodput as goodput_lib, hardware as hardware_lib, lock, peers,
                            restart)
from jaxtrain.train.log import Log, Pending, comm_bytes, peak_flops_total, readable
from jaxtrain.train.preemption import Preemption
from jaxtrain.train.workdir import check_workdir, write_config

# the progress bar redraws at most this often (notebooks keep every redraw)
PROGRESS_INTERVAL_S = 1.0


def train(cfg, workdir: str, *, task=None, devices=None, progress: bool = True,
          sync_every_step: bool = False, start_over: bool = False, evaluator=None,
          hardware=None) -> dict:
  """Trains `task` (default: the one train.task names) in `workdir`, resuming from its newest
  checkpoint; returns the last logged metrics.

  `devices` defaults to all; `sync_every_step` blocks on each step (many virtual CPU devices on few
  cores have deadlocked XLA's collectives when steps were dispatched ahead); `start_over` deletes
  the workdir's checkpoints and logs (needed when they come from an incompatible config). Whatever
  happens, every sink and manager opened here is closed before it returns or raises. The workdir is
  locked for the run: a second run on it is refused (one line). Multi-process: a lost peer ends
  every survivor with one line and status 6 within ~1.2 x `train.peer_timeout_s`
  (train/peers.py). `evaluator(cfg, workdir, run, state)` -> None or a callback scoring the params
  between steps (default: eval.tasks' jaxtrain/eval/loop.py from_config). `hardware`: the
  `train.hardware.Health` read every checkpoint.health_every_steps (default: this host's)."""
  startup = restart.Startup()  # from the process's creation to the first step: a restart's row
  with peers.watch(cfg.train.peer_timeout_s), lock.hold(workdir):
    goodput = goodput_lib.Goodput()  # every interval from here on is charged to one of its buckets
    devices = jax.devices() if devices is None else devices
    startup.charge("backend")
    given = cfg
    with _out_of_memory(cfg, devices):
      cfg, auto_row = auto.resolve(cfg, devices)  # batch_size/microbatches=auto: chosen, confirmed
    rows = [auto_row] if auto_row else []
    args = (workdir, task, devices, progress, sync_every_step, evaluator, startup, hardware)
    try:
      with _out_of_memory(cfg, devices):
        return _train(cfg, rows, start_over, goodput, *args)
    except errors.OutOfMemory as e:
      retry = _oom_retry(given, cfg, len(devices), e)
      if retry is None:
        raise
    # the failed attempt's frames and buffers are gone with its exception
    with _out_of_memory(retry[0], devices):
      return _train(retry[0], [retry[1]], False, goodput_lib.Goodput(), *args)


@contextlib.contextmanager
def _out_of_memory(cfg, devices):
  """An allocation XLA (or Python) refused becomes errors.OutOfMemory: one line with the planner's
  advice."""
  try:
    yield
  except (jax.errors.JaxRuntimeError, MemoryError) as e:
    if not oom.is_out_of_memory(e):
      raise
    raise oom.failed(cfg, len(devices), e) from None


def _oom_retry(given, cfg, n_devices: int, e: errors.OutOfMemory):
  """(config, row) of the one retry train.batch_size=auto gets after running out of memory: twice
  the microbatches (the batch rounded down to a multiple they divide); else None."""
  if given.train.batch_size != config_lib.AUTO:
    return None
  microbatches = 2 * cfg.train.microbatches
  shape = config_lib.mesh_shape(cfg.mesh, n_devices)
  step = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"] * microbatches
  retry = auto.with_train(cfg, microbatches=microbatches,
                          batch_size=cfg.train.batch_size // step * step)
  try:
    config_lib.validate(retry, n_devices)
  except config_lib.ConfigError:
    return None
  t = retry.train
  if jax.process_index() == 0:
    print(f"{e}; retrying once with train.batch_size={t.batch_size} "
          f"train.microbatches={t.microbatches}", flush=True)
  return retry, {"event": "oom_retry", "batch_size": t.batch_size, "microbatches": t.microbatches,
                 "error": str(e)[:300]}


def _train(cfg, rows, start_over, goodput, workdir, task, devices, progress, sync_every_step,
           evaluator, startup, hardware) -> dict:
  startup.cache_dir = restart.use_compilation_cache(cfg.train.compilation_cache, workdir)
  config_lib.validate(cfg, len(devices))
  check_workdir(cfg, workdir, start_over)
  run = build(cfg, workdir, devices, task)
  calls.check_task(cfg, run.task)
  oom.check_host(cfg, len(devices), sum(d.process_index == jax.process_index() for d in devices))
  show = progress and jax.process_index() == 0

  with contextlib.ExitStack() as stack:
    goodput.energy = goodput_lib.gpu_energy_meter()  # None off NVIDIA GPUs or without nvidia-ml-py
    if goodput.energy is not None:
      stack.callback(goodput.energy.stop)
    # ---- data, opened before compiling: this process's rows of each global batch ----
    feed, train_iter = open_data(cfg, run, show)
    constants, sizes = run.task.constants(), run.task.sizes()
    if show and sizes:
      print(f"model: {sizes['params']:,} parameters, {sizes['active_params']:,} active per token",
            flush=True)
    write_config(cfg, workdir)

    # ---- sinks and state: the newest complete checkpoint of any tier, or born sharded ----
    writer = metrics_lib.MetricsWriter(workdir, enabled=jax.process_index() == 0)
    stack.callback(writer.close)
    for row in rows:  # auto_batch, oom_retry
      writer.write(0, row)
    ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, agree=peers.agree)
    stack.callback(ckpts.close)
    resumed = ckpts.latest()[0] is not None
    startup.charge("setup")
    state, shardings = start_state(cfg, workdir, run, ckpts, goodput, writer, train_iter)
    startup.charge("restore")
    goodput.charge("init")

    # ---- compile once, with the logical rules and mesh in context ----
    stack.enter_context(parallel.activate(run.mesh, cfg.mesh.rules))
    train_fn, eval_fn = compile_steps(cfg, *run, shardings)
    train_fns = {1: train_fn}  # steps per call -> its program
    if cfg.train.steps_per_call > 1:
      train_fns[cfg.train.steps_per_call] = compile_call(cfg, *run, shardings)
    peak, peak_source = peak_flops_total(cfg, workdir)
    bar = stack.enter_context(tqdm.auto.tqdm(total=cfg.train.steps, initial=int(state.step),
                                             disable=not show, dynamic_ncols=True,
                                             mininterval=PROGRESS_INTERVAL_S))
    units = jax.process_count() if jax.default_backend() == "cpu" else jax.device_count()  # paid
    log = Log(writer, bar, constants, run.task, peak, per_replica_metrics(cfg),
              lambda s: goodput.row(s, run.task.tokens_per_batch, cfg.train.gpu_hour_price, units))
    loop = Loop(cfg, run, feed, train_iter, state, train_fns, eval_fn, log, ckpts, goodput,
                checkpoint_meta(cfg, workdir), sync_every_step, show)
    if evaluator is None:  # eval.tasks scored between steps (eval shares train's floor)
      from jaxtrain.eval import loop as eval_loop
      evaluator = eval_loop.from_config
    loop.tasks = evaluator(cfg, workdir, run, state)
    loop.hardware = hardware or hardware_lib.Health.of_host(
        checkpoint.tier_dirs(cfg.checkpoint, workdir),
        [d.local_hardware_id for d in jax.local_devices()], jax.default_backend() == "gpu")
    loop.startup = startup if resumed else None
    goodput.charge("init")  # jitting, the peak FLOP/s probe

    # ---- loop: dispatch the call of step n (steps n..n+k-1: train.steps_per_call), then read
    # the previous call's metrics; SIGTERM/SIGINT: save and stop ----
    loop.preemption = stack.enter_context(Preemption())
    every = calls.intervals(cfg)
    while loop.step < cfg.train.steps:
      k = calls.size(loop.step, cfg, every)
      batch = loop.next_batch(k)
      if batch is None:  # Ctrl-C while it was read
        break
      step_metrics = loop.dispatch(batch, k)
      if loop.read_previous():  # diverged: rolled back to the last good checkpoint
        continue
      loop.schedule_logs(step_metrics, k)
      is_last = loop.step == cfg.train.steps
      if loop.stop_requested():
        break
      loop.check_hardware()
      loop.save(is_last)
    loop.read_last()

    # ---- the end (also after a preemption): a forced save to the persistent tier ----
    totals = loop.finish()
  state = loop.state
  return {**loop.last, "peak_flops": peak, "peak_source": peak_source, "step": int(state.step),
          "rollbacks": loop.rollbacks, **sizes, **constants, **totals}


def open_data(cfg, run: Run, show: bool):
  """(feed, train iterator): this process's rows of each global batch; a missing corpus or one
  without usable documents is one ConfigError line, now rather than at the first evaluation."""
  feed = parallel.Feed(run.task.batch_size, parallel.batch_sharding(run.mesh))
  try:
    run.task.prepare(show)
    train_iter = run.task.batches("train", feed.lo, feed.hi)
    if cfg.train.eval_every:
      run.task.batches("eval", feed.lo, feed.hi)
  except (FileNotFoundError, ValueError) as e:
    raise config_lib.ConfigError(str(e)) from e
  return feed, train_iter


def poisoned(rows: dict) -> dict:
  """A batch whose float arrays (the loss mask, ...) are NaN: train.nan_steps's injected fault."""
  floats = {k: np.full_like(v, np.nan) for k, v in rows.items()
            if np.issubdtype(np.asarray(v).dtype, np.floating)}
  if not floats:
    raise config_lib.ConfigError("train.nan_steps: this task's batches hold no float array to "
                                 "poison")
  return {**rows, **floats}


def start_state(cfg, workdir: str, run: Run, ckpts, goodput, writer, train_iter):
  """(state, shardings): the newest complete checkpoint of any tier read straight into its shardings
  (the data iterator's state with it), else the state born sharded, its params from
  checkpoint.init_from when set."""
  if ckpts.latest()[0] is not None:
    goodput.charge("init")
    state, shardings, data_state, row = restore_state(ckpts, run.task, run.tx, run.mesh,
                                                      cfg.mesh.rules, offload=cfg.train.offload)
    goodput.charge("restore")
    goodput.resume(goodput_lib.history(workdir), int(state.step))
    train_iter.set_state(data_state)
    writer.write(int(state.step), row)
    return state, shardings
  state, shardings = state_lib.create_state(run.task, run.tx, cfg.train.seed, run.mesh,
                                            cfg.mesh.rules, cfg.train.offload)
  if cfg.checkpoint.init_from:
    load = lambda like, step=None: init_params(cfg.checkpoint.init_from, like, step)
    params, task_state = run.task.init_from(state.params, state.task_state, load)
    state = state.replace(params=params, task_state=task_state)
  return state, shardings


def checkpoint_meta(cfg, workdir: str) -> dict:
  """What a checkpoint carries beside the arrays: the config and the tokenizer reference."""
  ref = os.path.join(workdir, "tokenizer_ref.json")
  tokenizer = None
  if os.path.isfile(ref):
    with open(ref) as f:
      tokenizer = json.load(f)
  return {"config": cfg.to_dict(), "tokenizer": tokenizer}


def evaluate(eval_fn, state, feed, task, n: int) -> dict:
  """The task's eval metrics over the first n batches of a fresh eval iterator (a fixed held-out
  set)."""
  batches = task.batches("eval", feed.lo, feed.hi)
  sums = [jax.device_get(eval_fn(state.params, state.extra, state.task_state, feed.put(local)))
          for _, local in zip(range(n), batches)]
  return task.eval_metrics(sums)


class Loop:
  """What the loop carries from step to step: the state and step, the previous step's metrics (read
  one step late, `Pending`), the last logged row, the rollbacks, and the sinks each phase charges or
  writes."""

  def __init__(self, cfg, run: Run, feed, train_iter, state, train_fns: dict, eval_fn, log: Log,
               ckpts, goodput, meta: dict, sync_every_step: bool, show: bool):
    self.cfg, self.run, self.feed, self.train_iter = cfg, run, feed, train_iter
    # steps per call -> its jitted program, and the ones compiled so far
    self.state, self.train_fns, self.eval_fn, self.compiled = state, train_fns, eval_fn, {}
    self.log, self.ckpts, self.goodput, self.meta = log, ckpts, goodput, meta
    self.sync_every_step, self.show, self.preemption = sync_every_step, show, None
    self.step = self.start = int(state.step)
    self.nan_steps = config_lib.nan_steps(cfg.train)  # fault injection: poisoned batches
    self.pending: list[Pending] = []  # the previous call's steps
    self.last, self.rollbacks = {}, 0
    self.adaptive = any(tier.adaptive for tier in ckpts.tiers)
    self.tasks = None  # the in-loop task evaluator (train's `evaluator`)
    self.hardware = None  # train.hardware.Health
    self.startup = None  # a resumed run's restart.Startup, until its first step
    self.gather = readable(run.mesh, log.per_replica)

  def next_batch(self, k: int = 1):
    """This step's batch (task.make_batch of the fed rows), or a call's k batches fed together
    (stacked, the fed rows unchanged: calls.check_task), or None after a Ctrl-C in host code
    without the handler (a second one, or a task's own): the batch it was reading is the resumed
    run's first."""
    data_state = self.train_iter.get_state()
    try:
      rows = []
      for n in range(self.step + 1, self.step + 1 + k):
        local = next(self.train_iter)
        rows.append(poisoned(local) if n in self.nan_steps else local)
      self.goodput.charge("data")
      if k > 1:
        return self.feed.put_many(rows)
      s = self.state
      return self.run.task.make_batch(s.params, s.extra, s.task_state, self.feed.put(rows[0]),
                                      self.step)
    except KeyboardInterrupt:
      self.train_iter.set_state(data_state)
      self.last["preempted"] = self.preemption.requested = "KeyboardInterrupt"
      self.log_last_pending()
      return None

  def dispatch(self, batch, k: int = 1):
    """Runs the call of k steps; its metrics stay on the device. Each program is compiled at its
    first call, here; the first one's HLO says what a step sends (comm_bytes: a call's bytes over
    its k steps)."""
    if k not in self.compiled:
      self.goodput.charge("step")
      if self.startup:
        self.startup.charge("setup")
      self.compiled[k] = self.train_fns[k].lower(self.state, batch).compile()
      if len(self.compiled) == 1:
        sent = comm_bytes(self.compiled[k].as_text(), self.run.mesh)
        self.log.constants.update(sent if k == 1 else {name: n / k for name, n in sent.items()})
      self.goodput.charge("compile")
      if self.startup:
        self.startup.charge("compile")
    self.state, step_metrics = self.compiled[k](self.state, batch)
    step_metrics = self.gather(step_metrics)
    if self.sync_every_step or self.startup:
      jax.block_until_ready(step_metrics)
    if self.startup:  # a restart's first step has finished: where its time went
      self.startup.charge("first_step")
      self.log.event(self.step + 1, self.startup.row())
      self.startup = None
    return step_metrics

  def read_previous(self) -> bool:
    """The previous step's metrics, read while this one runs: the save policy's warning signs, the
    divergence counter, its row when due. True when it diverged and the state was rolled back."""
    for i, p in enumerate(self.pending):
      health = self.log.health(p)
      if self.adaptive:
        self.decisions(p.step, self.ckpts.observe(p.step, health["loss"], health["grad_norm"],
                                                  health["skipped_steps"]))
      if health["consecutive_skips"] >= self.cfg.optim.max_consecutive_skips:
        self.log.steps(self.pending[:i])  # the call's steps before it
        self.roll_back(p)
        return True
    self.last = self.log.steps(self.pending) or self.last
    return False

  def roll_back(self, p: Pending):
    """To the last good checkpoint (optim.on_divergence=rollback), or errors.Diverged."""
    self.log.step(p._replace(due=True, extra={}))
    self.goodput.charge("step", p.step)
    self.state, self.step = _rollback(self.cfg, self.ckpts, self.run, p.step, self.rollbacks)
    self.goodput.charge("restore")
    self.goodput.rewind(self.step, p.step)
    self.rollbacks += 1
    self.log.event(self.step,
                   {"event": "rollback", "from_step": p.step, "rollbacks": self.rollbacks})
    self.pending = []
    self.log.restart_window()

  def schedule_logs(self, step_metrics, k: int):
    """The call's k steps become the pending ones (step advances by k); calls.size ended the call
    where an evaluation is due, so the state evaluated is its last step's."""
    self.pending = []
    for i in range(k):
      self.schedule_log(step_metrics, self.step + 1 == self.cfg.train.steps,
                        None if k == 1 else i)
      self.step += 1

  def schedule_log(self, step_metrics, is_last: bool, index: int | None = None):
    """This step's metrics (its entry `index` of a call's) join the pending ones, with the
    evaluation's results when one is due. The first step is always logged alone: its time includes
    compilation, later windows' do not."""
    t, n = self.cfg.train, self.step + 1
    self.log.window_steps += 1
    due = is_last or self.step == self.start or n % t.log_every == 0
    p = Pending(n, step_metrics, due, {}, index)
    if t.eval_every and (n % t.eval_every == 0 or is_last):
      p = p._replace(due=True, extra=self.evaluate(n))
    if self.tasks is not None and self.tasks.due(n, is_last):
      p = p._replace(due=True, extra={**p.extra, **self.evaluate(n, self.tasks)})
    self.pending.append(p)

  def evaluate(self, n: int, tasks=None) -> dict:
    """Eval loss (or with `tasks`, the in-loop tasks' columns), charged to goodput's eval badput."""
    # the step's own time stays in the step's window, the eval's not
    jax.block_until_ready(self.state)
    self.goodput.charge("step", n)
    eval_start = time.perf_counter()
    if tasks is None:
      result = evaluate(self.eval_fn, self.state, self.feed, self.run.task,
                        self.cfg.train.eval_batches)
    else:
      result = tasks(n, self.state.params, self.state.extra)
    seconds = time.perf_counter() - eval_start
    result["eval_time_s" if tasks is None else "eval/time_s"] = seconds
    self.goodput.charge("eval")
    self.log.window_start += seconds
    if self.show:
      shown = {k: v for k, v in result.items()
               if not k.endswith(("time_s", "_stderr", "/docs", "/truncated"))}
      self.log.bar.write(f"step {n}: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items()))
    return result

  def stop_requested(self) -> bool:
    """SIGTERM/SIGINT (or the preemption notice): the pending step is logged and the run saves."""
    if not self.preemption.check(self.step):
      return False
    self.log_last_pending()
    self.last["preempted"] = self.preemption.requested
    return True

  def log_last_pending(self):
    """The newest dispatched step is logged when read (a run that stops early)."""
    if self.pending:
      self.pending[-1] = self.pending[-1]._replace(due=True)

  def check_hardware(self):
    """Every checkpoint.health_every_steps: the run's hardware risk (every process's readings), a
    `hardware_health` row, and the adaptive policies' answer (a shorter interval)."""
    every = self.cfg.checkpoint.health_every_steps
    if not every or self.step % every:
      return
    row = hardware_lib.read_run(self.hardware, peers.gather)
    self.log.event(self.step, {"event": "hardware_health", **row})
    if self.adaptive:
      self.decisions(self.step, self.ckpts.hardware(self.step, row["risk"], row["why"]))

  def save(self, is_last: bool):
    """A save when a tier is due (not at the last step: the end saves), then the finished background
    saves' rows; errors.SaveFailed after checkpoint.max_failed_saves failed saves of a tier in a
    row."""
    if not is_last and (due := self.ckpts.due(self.step)):
      jax.block_until_ready(self.state)  # the save waits for its step: that wait is the step's
      self.goodput.charge("step", self.step)
      self.decisions(self.step, self.ckpts.save(self.step, self.state, self.train_iter.get_state(),
                                                self.meta, due))
      self.goodput.charge("checkpoint")
    self.saved()
    self.ckpts.check()
    self.goodput.charge("step", self.step)

  def read_last(self):
    """The last dispatched step's metrics, logged; errors.Diverged when it ended a run of non-finite
    updates."""
    o = self.cfg.optim
    for p in self.pending:
      if self.log.health(p)["consecutive_skips"] >= o.max_consecutive_skips:
        raise errors.Diverged(
            f"training diverged: the last {o.max_consecutive_skips} updates up to step "
            f"{p.step} were not finite (optim.max_consecutive_skips); lower optim.lr")
    self.last.update(self.log.steps(self.pending))

  def finish(self) -> dict:
    """The forced save of the final state to the persistent tier, waited for; the goodput totals."""
    step = int(self.state.step)
    jax.block_until_ready(self.state)
    self.goodput.charge("step", step)
    self.ckpts.save(step, self.state, self.train_iter.get_state(), self.meta,
                    self.ckpts.persistent())
    self.ckpts.wait()
    self.goodput.charge("checkpoint")
    self.saved()
    self.ckpts.check(final=True)  # errors.SaveFailed when the final save failed
    totals = self.log.goodput(step)
    self.log.event(step, {"event": "goodput", **totals})
    if self.show:
      self.log.bar.write(goodput_lib.summary(totals))
    return totals

  def saved(self):
    for record in self.ckpts.finished_saves():  # also where a failed background save is noticed
      self.log.event(record.step, record.row())

  def decisions(self, step: int, decisions: list[str]):
    for decision in decisions:
      self.log.event(step, {"event": "checkpoint_policy", "decision": decision})


def _rollback(cfg, ckpts, run: Run, step: int, rollbacks: int):
  """(state, step) of the last good checkpoint, or errors.Diverged when there is none or rollbacks
  ran out."""
  o = cfg.optim
  why = (
      f"training diverged: {o.max_consecutive_skips} non-finite updates in a row up to step {step} "
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
  state = restore_state(ckpts, run.task, run.tx, run.mesh, cfg.mesh.rules, good,
                        cfg.train.offload)[0]
  return state, good
