"""What a run logs: rows of metrics.jsonl (read one step late, so the loop never waits on the
device), the progress bar, and the constants a row carries (peak FLOP/s, the compiled step's bytes
per mesh axis)."""

import os
import time
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import metrics as metrics_lib
from jaxtrain.parallel import hlo_bytes


class Pending(NamedTuple):
  """A dispatched step whose metrics are read after the next call is dispatched."""
  step: int  # the step count after it
  metrics: dict  # on the device until read
  due: bool  # logged when read
  extra: dict  # the evaluation results logged in the same row ({} when none)
  index: int | None = None  # its entry of a call's metrics (one per step), None: a call of one


def peak_flops_total(cfg, workdir: str | None = None) -> tuple[float, str]:
  """Peak FLOP/s of the whole job: per device on accelerators, per host on CPU (shared cores; the
  probe's result kept in WORKDIR/peak_flops.json for restarts on the same host)."""
  kept = os.path.join(workdir, "peak_flops.json") if workdir else None
  peak, source = metrics_lib.peak_flops(cfg.model.compute_dtype, kept)
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
  """`metrics -> metrics` that this process can read on the host. Per-replica metrics lie on the
  replica axis, which may span processes (then no process can fetch them whole): there they are
  gathered, replicated, by a small program dispatched right behind the step, so the one-step-late
  read finds them ready on every process, which all take the same decisions from them. The step
  itself still sends nothing over the axis between syncs. One process, or metrics already reduced:
  nothing to do."""
  if not (per_replica and jax.process_count() > 1):
    return lambda step_metrics: step_metrics
  return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


def read_metrics(step_metrics, per_replica: bool, index: int | None = None) -> dict:
  """A step's metrics on the host (`index`: its entry of a call's metrics); per-replica ones (a
  leading axis of one entry per replica) reduced: the worst for the skip counters, the mean for
  the rest."""
  values = jax.device_get(step_metrics)  # a call's arrays are fetched once, at their first read
  if index is not None:
    values = {k: v[index] for k, v in values.items()}
  if not per_replica:
    return values
  worst = ("skipped_steps", "consecutive_skips")
  return {k: np.max(v, axis=0) if k in worst else np.mean(v, axis=0) for k, v in values.items()}


class Log:
  """Rows of metrics.jsonl and the progress bar. A step's metrics are read one step late (after the
  next step was dispatched), so the loop never waits on the device for them."""

  def __init__(self, writer, bar, constants: dict, task, peak: float, per_replica: bool = False,
               goodput=None):
    self.writer, self.bar, self.constants, self.peak = writer, bar, constants, peak
    # goodput: step -> its cumulative columns, or None
    self.per_replica, self.goodput = per_replica, goodput
    self.tokens, self.flops = task.tokens_per_batch, task.flops_per_token
    self.restart_window()

  def restart_window(self):
    self.window_start, self.window_steps = time.perf_counter(), 0

  def event(self, step: int, row: dict):
    self.writer.write(step, row)

  def step(self, pending: Pending) -> dict:
    """Logs a finished step's metrics (and its eval results) when due. Returns the row or {}."""
    return self.steps([pending])

  def steps(self, pendings: list[Pending]) -> dict:
    """Logs the due ones of finished steps (one call's), each at the window's time per step: the
    steps of one call finish together. Returns the last row or {}."""
    due = [p for p in pendings if p.due]
    if not due:
      return {}
    step_time = (time.perf_counter() - self.window_start) / max(self.window_steps, 1)
    for p in due:
      row = self._row(p, step_time)
    self.restart_window()
    return row

  def _row(self, pending: Pending, step_time: float) -> dict:
    step, step_metrics, _, extra, index = pending
    values = {**{k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
                 for k, v in read_metrics(step_metrics, self.per_replica, index).items()}, **extra}
    row = {**values, "step_time_s": step_time, **self.constants}
    if self.tokens:
      row.update(tokens_per_sec=self.tokens / step_time,
                 mfu=self.flops * self.tokens / step_time / self.peak)
    if self.goodput is not None:
      row.update(self.goodput(step))
    self.writer.write(step, row)
    self.bar.update(step - self.bar.n)
    self.bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{row.get('tokens_per_sec', 0):,.0f}",
                         mfu=f"{row.get('mfu', 0):.1%}", refresh=False)
    return row

  def health(self, pending: Pending) -> dict:
    """The few scalars read every step: the save policy's warning signs and the divergence
    counter."""
    keys = ("loss", "grad_norm", "skipped_steps", "consecutive_skips")
    read = read_metrics({k: pending.metrics[k] for k in keys}, self.per_replica, pending.index)
    return {k: float(v) for k, v in read.items()}
