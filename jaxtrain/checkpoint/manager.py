"""Tiered, asynchronous, crash-safe checkpoints of any train state, with Orbax underneath.

A tier is an Orbax `CheckpointManager` directory of integer steps. Each step holds three items:
`state` (the train state pytree, arrays through TensorStore), `data` (each process's data
iterator state, one JSON file per process) and `meta` (config and tokenizer reference). Orbax
writes a step into a temporary directory and renames it when complete, so a step that was
being written when the process died is never listed, and is removed at the next start.

Two tiers: a *fast* one (local disk or RAM disk, saved often, kept short) and a *persistent*
one (any path, or an `s3://` or `gs://` URL, saved less often, kept by a preservation policy). Each
saves asynchronously under its own save policy; restore takes the newest complete step of either.
On object storage, which has no rename, a step is written in place and committed by a
`commit_success.txt` written last (object_store.py).

A save that fails (a full or read-only disk), in its blocking part or on Orbax's background
thread, is one line on stderr and one `checkpoint_error` record; training goes on and the next
due save retries. `check` ends the run (errors.SaveFailed) when `checkpoint.max_failed_saves`
saves of a tier failed in a row, or the final save failed. Over several processes a local tier's
directory is probed by process 0 before each save and the verdict agreed: Orbax makes the step's
directory on process 0 alone, between two barriers, so a failure there left the other processes
waiting 300 s at the second barrier while process 0 trained on into a collective they never joined,
and their barrier counters out of step for every later save (orbax 0.12). A fault that lands in
the milliseconds between the probe and Orbax's mkdir still does that.
"""

import dataclasses
import json
import os
import shutil
import sys
import threading
import time

import flax.serialization
import jax
import orbax.checkpoint as ocp
import tqdm
from etils import epath

from jaxtrain import errors
from jaxtrain.checkpoint import object_store, policy as policy_lib, quiet

FORMAT = 1


# ---- the per-process data iterator state, as an Orbax item ----

class DataStateHandler(ocp.CheckpointHandler):
  """Writes `process_I.json` for this process. The iterators' state is the same on every process
  (jaxtrain's pipelines pack the global stream), so a restore under another process count reads
  its own file when present and process 0's otherwise."""

  def save(self, directory: epath.Path, args: "DataSave"):
    (directory / f"process_{jax.process_index()}.json").write_text(json.dumps(args.state))

  def restore(self, directory: epath.Path, args: "DataRestore" = None) -> dict:
    path = directory / f"process_{jax.process_index()}.json"
    if not path.exists():
      path = directory / "process_0.json"
    return json.loads(path.read_text())

  def metadata(self, directory):
    return None

  def finalize(self, directory):
    pass

  def close(self):
    pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
  pass


def _handlers(compress: bool = False, ocdbt: bool = True):
  return {"state": ocp.PyTreeCheckpointHandler(use_compression=compress, use_ocdbt=ocdbt),
          "data": DataStateHandler(), "meta": ocp.JsonCheckpointHandler()}


# ---- tiers ----

@dataclasses.dataclass
class SaveRecord:
  """One save: blocking time on the loop, then (once Orbax finalized it) bytes and throughput, or
  why it failed."""
  tier: str
  step: int
  bytes: int
  blocking_s: float
  started: float
  finished: float | None = None
  error: str | None = None
  settled: bool = False  # complete on disk, or failed

  def row(self) -> dict:
    if self.error is not None:
      return {"event": "checkpoint_error", "tier": self.tier, "error": self.error}
    seconds = self.finished - self.started
    return {"event": "checkpoint_save", "tier": self.tier, "save_blocking_s": self.blocking_s,
            "save_bytes": self.bytes, "save_total_s": seconds,
            "save_MBps": self.bytes / seconds / 1e6}


def tier_dirs(k, workdir: str) -> dict[str, str]:
  """{"fast": dir (when configured), "persistent": dir} of a config's `checkpoint` section (a
  ConfigDict or the plain dict of a saved config.json) and its workdir."""
  dirs = {}
  if k.get("fast_dir"):
    dirs["fast"] = k["fast_dir"]
  dirs["persistent"] = k.get("dir") or os.path.join(os.path.abspath(workdir), "checkpoints")
  return dirs


@dataclasses.dataclass
class Tier:
  name: str
  directory: str
  manager: ocp.CheckpointManager
  adaptive: policy_lib.AdaptivePolicy | None = None
  decide: policy_lib.Settled | None = None
  failures: int = 0  # failed saves in a row
  failed: SaveRecord | None = None  # the last save, when it failed


def _abs(directory: str) -> str:
  return directory if "://" in directory else os.path.abspath(directory)


def _reason(e: BaseException) -> str:
  """An exception as one line (TensorStore's carry the OS error: `... No space left on device
  [os_error_code=28]`)."""
  return " ".join(str(e).split()) or type(e).__name__


def _probe(directory: str) -> str:
  """"" when a directory can be made in `directory` now (made and removed), else why not."""
  probe = os.path.join(directory, f".jaxtrain-probe-{os.getpid()}")
  try:
    os.makedirs(probe, exist_ok=True)
    os.rmdir(probe)
  except OSError as e:
    return _reason(e)
  return ""


class Checkpoints:
  """The tiers of one run: `save` (each tier by its policy, or forced), `restore` (newest complete
  step of any tier), `finished_saves` (records of saves Orbax has finalized since the last call)."""

  def __init__(self, k, workdir: str, *, read_only: bool = False, agree=None):
    """`k`: the `checkpoint` config section (ConfigDict). `agree(name, value)`: process 0's value on
    every process (the loop passes train.peers.agree); without it, or on one process, no probe."""
    quiet.install()
    self._agree = agree
    dirs = tier_dirs(k, workdir)
    if any(object_store.is_s3(d) for d in dirs.values()):
      object_store.configure(k)
    self._compress, self._ocdbt = bool(k.compress), bool(k.ocdbt)
    self._max_failed = 0 if read_only else k.max_failed_saves
    self.tiers: list[Tier] = []
    for name, directory in dirs.items():
      fast = name == "fast"
      adaptive = None
      if k.adaptive and (fast or "fast" not in dirs):  # the frequent tier adapts
        adaptive = policy_lib.AdaptivePolicy(k.adaptive_min_steps, k.adaptive_max_steps,
                                             k.adaptive_spike)
      decide = policy_lib.save_policy(k.fast_every_steps if fast else k.every_steps,
                                      k.fast_every_seconds if fast else k.every_seconds, adaptive)
      if decide is not None:
        decide = policy_lib.Settled(decide, lambda name=name: self._in_flight(name))
      self.tiers.append(Tier(name, _abs(directory), None, adaptive, decide))
      self.tiers[-1].manager = self._manager(self.tiers[-1], decide,
                                             k.fast_keep if fast else k.keep,
                                             0 if fast else k.keep_every_steps, read_only)
    self._records: list[SaveRecord] = []
    self._lock = threading.Lock()

  def _manager(self, tier: Tier, decide, keep: int, keep_every_steps: int, read_only: bool):
    def finalized():  # Orbax's post-finalization callback, on its background thread: the oldest
      with self._lock:  # unfinished save of this tier (Orbax runs one save per manager at a time)
        r = next((r for r in self._records if r.tier == tier.name and r.finished is None), None)
        if r is not None:
          r.finished = time.perf_counter()
    if read_only:
      decide = None
    # Directories are made in the blocking part of a save: made on Orbax's background thread, a
    # failure (a read-only or vanished directory) left the blocking part waiting 300 s for a signal
    # that never came (orbax 0.12).
    async_options = ocp.AsyncOptions(post_finalization_callback=finalized,
                                     create_directories_asynchronously=False)
    options = ocp.CheckpointManagerOptions(
        create=not read_only, read_only=read_only, cleanup_tmp_directories=not read_only,
        save_decision_policy=decide or policy_lib.policies.SpecificStepsPolicy(()),
        preservation_policy=policy_lib.preservation_policy(keep, keep_every_steps, tier.adaptive),
        async_options=async_options, enable_background_delete=False,
        atomicity_options=object_store.COMMIT_FILE if object_store.is_s3(tier.directory) else None)
    handlers = _handlers(self._compress, self._ocdbt)
    return ocp.CheckpointManager(tier.directory, options=options, item_handlers=handlers)

  # ---- which steps exist ----

  def latest(self) -> tuple[int, Tier] | tuple[None, None]:
    """The newest complete step across tiers (the fast tier wins a tie: it is nearer)."""
    best = (None, None)
    for tier in self.tiers:
      step = tier.manager.latest_step()
      if step is not None and (best[0] is None or step > best[0]):
        best = (step, tier)
    return best

  def latest_good(self) -> int | None:
    """The newest complete step saved while training was calm (AdaptivePolicy: no spike, no
    non-finite loss, no skipped update before it or at the step after it); None without an adaptive
    tier."""
    good = []
    for tier in (t for t in self.tiers if t.adaptive):
      self._settle(tier, block=False)
      in_flight = {r.step for r in self._pending(tier.name)}
      good.append(
          tier.adaptive.newest_good(s for s in tier.manager.all_steps() if s not in in_flight))
    return max((s for s in good if s is not None), default=None)

  # ---- save ----

  def observe(self, step: int, loss: float, grad_norm: float, skipped: float) -> list[str]:
    """Feeds the adaptive policies; returns their logged decisions."""
    return [f"{t.name}: {d}" for t in self.tiers if t.adaptive
            for d in [t.adaptive.observe(step, loss, grad_norm, skipped)] if d]

  def hardware(self, step: int, risk: float, why: str) -> list[str]:
    """Feeds the run's hardware risk to the adaptive policies; returns their logged decisions."""
    return [f"{t.name}: {d}" for t in self.tiers if t.adaptive
            for d in [t.adaptive.hardware(step, risk, why)] if d]

  def due(self, step: int) -> list[Tier]:
    return [t for t in self.tiers if t.manager.should_save(step)]

  def save(self, step: int, state, data_state: dict, meta: dict,
           tiers: list[Tier] | None = None) -> list[str]:
    """Starts an asynchronous save of `step` on `tiers` (default: those whose policy says so);
    returns the adaptive policies' decisions that the save caused."""
    decisions = []
    tree = flax.serialization.to_state_dict(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    # The step that produced `state` may still be running: wait for it first, so that the blocking
    # time below is the save's own (the loop would wait for that step at its next read anyway).
    jax.block_until_ready(tree)
    for tier in self.due(step) if tiers is None else tiers:
      start = time.perf_counter()
      self._settle(tier, block=True)  # Orbax would wait for this tier's previous save anyway
      if tier.manager.latest_step() == step or (self._max_failed and
                                                tier.failures >= self._max_failed):
        # saved already, or failed too often: check() ends the run after its rows are written
        continue
      args = ocp.args.Composite(state=ocp.args.PyTreeSave(tree), data=DataSave(data_state),
                                meta=ocp.args.JsonSave({"format": FORMAT, **meta}))
      record = SaveRecord(tier.name, step, nbytes, 0.0, time.perf_counter())
      with self._lock:
        self._records.append(record)
      if why := self._unwritable(tier):
        self._failed(tier, record, OSError(why))
        continue
      try:
        tier.manager.save(step, args=args, force=True)
      except Exception as e:  # a disk fault in the blocking part: the next due save retries
        self._failed(tier, record, e)
        continue
      record.blocking_s = time.perf_counter() - start
      if tier.adaptive and (d := tier.adaptive.saved(step)):
        decisions.append(f"{tier.name}: {d}")
    return decisions

  def _unwritable(self, tier: Tier) -> str:
    """Over several processes, for a local tier: why process 0 cannot make a step directory in it
    now ("" when it can), agreed by every process; else ""."""
    if self._agree is None or jax.process_count() == 1 or "://" in tier.directory:
      return ""
    return self._agree(f"checkpoint/{tier.name}/probe",
                       _probe(tier.directory) if jax.process_index() == 0 else "")

  def persistent(self) -> list[Tier]:
    return [t for t in self.tiers if t.name == "persistent"]

  def finished_saves(self) -> list[SaveRecord]:
    """The saves that ended since the last call: complete (`checkpoint_save` rows) or failed
    (`checkpoint_error`)."""
    for tier in self.tiers:
      self._settle(tier, block=False)
    with self._lock:
      done = [r for r in self._records if r.settled]
      self._records = [r for r in self._records if not r.settled]
    return done

  def check(self, final: bool = False):
    """Raises errors.SaveFailed when a tier failed `checkpoint.max_failed_saves` saves in a row or,
    with `final` (after the final save and `wait`), when the persistent tier's last save failed."""
    for tier in self.tiers:
      last = tier.failed
      if last is not None and final and tier.name == "persistent":
        raise errors.SaveFailed(
            f"the final checkpoint save at step {last.step} failed ({tier.name}): {last.error}")
      if last is not None and tier.failures >= self._max_failed:
        raise errors.SaveFailed(
            f"checkpoint saves to the {tier.name} tier failed {tier.failures} times in a row; "
            f"the last, at step {last.step}: {last.error}")

  def wait(self):
    """Blocks until every save in flight is complete or failed (a failure is recorded,
    not raised)."""
    for tier in self.tiers:
      self._settle(tier, block=True)

  def close(self):
    self.wait()
    for tier in self.tiers:
      tier.manager.close()

  # ---- saves in flight, and failed ones ----

  def _pending(self, name: str) -> list[SaveRecord]:
    with self._lock:
      return [r for r in self._records if r.tier == name and not r.settled]

  def _in_flight(self, name: str) -> bool:
    return bool(self._pending(name))

  def _settle(self, tier: Tier, block: bool):
    """Ends the tier's save in flight once Orbax is done with it (at once with `block`):
    complete, or failed."""
    pending = self._pending(tier.name)
    if not pending or (not block and tier.manager.is_saving_in_progress()):
      return
    try:
      tier.manager.wait_until_finished()
    except Exception as e:  # the commit failed on Orbax's background thread
      for record in pending:
        self._failed(tier, record, e)
      return
    with self._lock:
      for record in pending:
        record.finished, record.settled = record.finished or time.perf_counter(), True
    tier.failures, tier.failed = 0, None

  def _failed(self, tier: Tier, record: SaveRecord, e: Exception):
    """One line on stderr, the record's error, and no half-written step left to fill the disk."""
    with self._lock:
      record.error, record.finished, record.settled = _reason(e), time.perf_counter(), True
    tier.failures, tier.failed = tier.failures + 1, record
    if tier.decide is not None:
      tier.decide.failed(record.step)
    tqdm.tqdm.write(f"checkpoint save failed at step {record.step} ({tier.name}): {record.error}",
                    file=sys.stderr)
    try:
      for partial in epath.Path(tier.directory).glob(f"{record.step}.orbax-checkpoint-tmp*"):
        partial.rmtree()
      step = epath.Path(tier.directory) / str(record.step)  # written in place, never committed
      if object_store.is_s3(tier.directory) and not (step / "commit_success.txt").exists():
        step.rmtree(missing_ok=True)
    except OSError:
      pass  # the directory itself is unusable; Orbax removes partial steps at the next start

  # ---- restore ----

  def restore(self, abstract_state, shardings, step: int | None = None, tier: Tier | None = None):
    """(state, data_state, meta, row): the train state read straight into `shardings`, the data
    iterator state, the meta item, and a metrics row (time, bytes, throughput)."""
    if step is None:
      step, tier = self.latest()
    elif tier is None:
      tier = next(t for t in self.tiers if step in t.manager.all_steps())
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract_state, shardings)
    start = time.perf_counter()
    target = flax.serialization.to_state_dict(target)
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
        target)
    restored = tier.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target, restore_args=restore_args), data=DataRestore(),
        meta=ocp.args.JsonRestore()))
    state = flax.serialization.from_state_dict(abstract_state, restored.state)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    nbytes = sum(x.nbytes for x in jax.tree.leaves(restored.state))  # what was read
    row = {"event": "checkpoint_restore", "tier": tier.name, "restore_s": seconds,
           "restore_bytes": nbytes, "restore_MBps": nbytes / seconds / 1e6}
    return state, restored.data, restored.meta, row

  # ---- after a rollback ----

  def delete_after(self, step: int) -> None:
    """Deletes every tier's steps newer than `step` (an abandoned trajectory after a rollback)."""
    self.wait()
    for tier in self.tiers:
      for s in tier.manager.all_steps():
        if s > step:
          tier.manager.delete(s)


def remove_tiers(k, workdir: str) -> None:
  """Deletes every tier's checkpoints (start over) of the `checkpoint` config section `k`."""
  for directory in tier_dirs(k, workdir).values():
    if object_store.is_s3(directory):
      object_store.configure(k)
    path = epath.Path(_abs(directory))
    if path.exists():
      if "://" in directory:
        path.rmtree()
      else:
        shutil.rmtree(path)
