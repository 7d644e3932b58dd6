"""What a config's training step sends over each mesh axis, counted in its compiled HLO, against the
float32 data-parallel baseline; and a stated model of what that costs on slow links.

`report(cfg)` compiles the step exactly as the loop does (`builder.compile_steps`, same mesh and
rules) but on abstract state and batch, so nothing is allocated; `parallel.hlo_bytes` counts the
bytes. "Over the reduced axis" (`optim.reduce_axis`, default replica) counts every collective whose
groups span that axis, alone or with others. `python -m jaxtrain comm --config=...
[--project]` prints `run(cfg, projection)`.
"""

import copy
import json
from typing import NamedTuple

import jax
import numpy as np

from jaxtrain import config as config_lib, config_files, metrics as metrics_lib
from jaxtrain.aot import compile as aot_compile
from jaxtrain.config import ModelConfig
from jaxtrain.model.transformer import param_count
from jaxtrain.parallel import hlo_bytes, hlo_schedule

# Dense bf16 peak of one H200 (NVIDIA H200 datasheet, no sparsity), from the table in
# jaxtrain/metrics.py.
H200_BF16_FLOPS = metrics_lib.PEAK_FLOPS["H200"]["bfloat16"]
PROJECTION_MODELS = ("gpt2_small", "llama_1b", "llama_8b")


def step_hlo(cfg, devices=None) -> tuple[str, jax.sharding.Mesh]:
  """(compiled HLO text of the train step of `cfg`, its mesh), compiled on abstract state and
  batch."""
  return aot_compile.scheduled(cfg, devices=devices)[:2]


def baseline_overrides(cfg) -> dict:
  """Dotted keys that turn `cfg` into its float32 data-parallel baseline: the explicit float32
  reduction over the axis the config reduces (comm.axis when it compresses or runs DiLoCo, else
  optim.reduce_axis, default replica), every other `comm` and `diloco` key at its default."""
  defaults = config_lib.default_config()
  out = {"optim.reduce_axis": reduced_axis(cfg)}
  out.update({f"comm.{k}": v for k, v in defaults.comm.items() if k != "axis"})
  out.update({f"diloco.{k}": v for k, v in defaults.diloco.items()})
  return out


def reduced_axis(cfg) -> str:
  return config_lib.manual_axis(cfg) or "replica"


def baseline(cfg):
  return with_overrides(cfg, baseline_overrides(cfg))


def with_overrides(cfg, overrides: dict):
  """A copy of `cfg` with dotted keys set to values (typed already, not strings)."""
  cfg = copy.deepcopy(cfg)
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
      node = node[part]
    node[leaf] = value
  return cfg


def measure(cfgs: list, devices=None, target: str | None = None) -> list[dict]:
  """For each config, the bytes per device per optimizer step of its step (its call of
  train.steps_per_call steps, per step): by (axes, dtype), in all, and over its reduced axis (every
  collective whose groups span it); its parameter count; and from the compiled schedule (on
  `target`, deviceless, else this host's devices), how much of the reduced axis's bytes overlap
  compute. Equal configs are compiled once."""
  keys, done = [json.dumps(cfg.to_dict(), sort_keys=True, default=str) for cfg in cfgs], {}
  for key, cfg in zip(keys, cfgs):
    if key not in done:
      text, mesh, state, k = aot_compile.scheduled(cfg, target, devices)
      rows, win = hlo_bytes.collectives(text, mesh), hlo_schedule.windows(text)
      axis, step_flops = reduced_axis(cfg), win.flops / k
      reduced = [r for r in rows if axis in r.axes]
      # per reduced-axis collective: (bytes per step, times it runs per step, the steps of matmul
      # work the schedule runs while one of its transfers is in flight)
      parts = [(r.per_step / k, r.runs / r.every / k,
                win.of(r.name) / step_flops if step_flops else 0.0) for r in reduced]
      period = {}  # a periodic sync's bytes per step, by its period in steps
      for r in rows:
        every = (cfg.diloco.inner_steps // max(cfg.diloco.fragments, 1)
                 if "diloco_sync" in r.op_name else r.every)
        if every > 1:
          period[every] = period.get(every, 0.0) + r.per_step / k
      every, average = max(period.items(), key=lambda item: item[0] * item[1], default=(1, 0.0))
      split = {}  # mesh axes -> [bytes per step, of them overlapping compute]
      for r in rows:
        entry = split.setdefault(hlo_bytes.axes_str(r.axes), [0.0, 0.0])
        entry[0] += r.per_step / k
        entry[1] += r.per_step / k if win.of(r.name) > 0 else 0.0
      done[key] = {"by_axis": {key_: b / k for key_, b in hlo_bytes.by_axis(rows).items()},
                   "total": hlo_bytes.total(rows) / k,
                   "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params)),
                   "reduced": sum(b for b, _, _ in parts),
                   "overlapped": sum(b for b, _, w in parts if w > 0), "parts": parts,
                   "flops": step_flops,  # matmul FLOPs per device per step, compiled
                   "overlap_by_axes": {a: tuple(v) for a, v in split.items() if v[0]},
                   # the largest periodic sync, once every `sync_every` steps, and the step that
                   # sends it (with everything sent every step)
                   "sync": average * every, "sync_every": every,
                   "peak_step": hlo_bytes.total(rows) / k - sum(period.values()) +
                                average * every}
  return [done[key] for key in keys]


def report(cfg, devices=None, target: str | None = None) -> dict:
  """Bytes per device per optimizer step of `cfg` and of its float32 data-parallel baseline, and
  baseline / config over the reduced axis (None when the config sends nothing over it)."""
  return _report(cfg, *measure([cfg, baseline(cfg)], devices, target), target)


def _report(cfg, config: dict, base: dict, target: str | None = None) -> dict:
  ratio = base["reduced"] / config["reduced"] if config["reduced"] else None
  return {"axis": reduced_axis(cfg), "config": config, "baseline": base, "ratio": ratio,
          "target": target}


def format_report(rep: dict) -> str:
  """An aligned table: mesh axes x dtype -> bytes per device per optimizer step, config and
  baseline."""
  config, base = rep["config"], rep["baseline"]
  table = [("axes", "dtype", "config", "f32 baseline")]
  keys = sorted(k for k in set(config["by_axis"]) | set(base["by_axis"])
                if config["by_axis"].get(k) or base["by_axis"].get(k))  # not groups of one device
  table += [(a, d, f"{config['by_axis'].get((a, d), 0):,.0f}",
             f"{base['by_axis'].get((a, d), 0):,.0f}") for a, d in keys]
  table.append(("total", "", f"{config['total']:,.0f}", f"{base['total']:,.0f}"))
  widths = [max(len(row[i]) for row in table) for i in range(4)]
  lines = ["bytes per device per optimizer step (compiled HLO, ring algorithms)"]
  lines += [
      "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in table
  ]
  a, ratio = rep["axis"], rep["ratio"]
  lines.append(f"over {a}: baseline / config = {ratio:.2f}x" if ratio is not None else
               f"over {a}: the config sends nothing (the baseline {base['reduced']:,.0f} bytes)")
  if config["sync"]:
    lines.append(f"largest single sync: {config['sync']:,.0f} bytes per device, once every "
                 f"{config['sync_every']} steps; the step that sends it: "
                 f"{config['peak_step']:,.0f} (the baseline's every step: "
                 f"{base['peak_step']:,.0f})")
  if rep.get("target"):
    lines.append(f"over {a}, in {rep['target']}'s compiled schedule: " + "; ".join(
        f"{name} {m['overlapped']:,.0f} overlap compute, {m['reduced'] - m['overlapped']:,.0f} "
        "exposed" for name, m in (("config", config), ("baseline", base))) +
        " (overlap: asynchronous, with matmuls between its start and done)")
    lines.append("config, by mesh axes: " + "; ".join(
        f"{axes} {hidden:,.0f} overlap compute, {b - hidden:,.0f} exposed"
        for axes, (b, hidden) in sorted(config["overlap_by_axes"].items())))
  return "\n".join(lines)


class Scheme(NamedTuple):
  """A way to reduce: dotted config keys set on the given config, and how many steps of compute per
  optimizer step its (per-step averaged) communication may hide behind: 0 for data parallelism; for
  streaming DiLoCo tau * P / H (each fragment sync, one every H/P steps, hides behind tau steps)."""
  name: str
  overrides: dict
  overlap_steps: float = 0.0


def default_schemes(cfg) -> list[Scheme]:
  return [Scheme("f32 data-parallel", baseline_overrides(cfg)), Scheme("this config", {})]


def run(cfg, projection: bool = False, schemes: list[Scheme] | None = None, devices=None,
        target: str | None = None) -> str:
  """What `python -m jaxtrain comm` prints: the report, and with `projection` the projected
  utilization of each scheme (default: the f32 baseline and this config) from its bytes per
  parameter over the reduced axis, measured on this config's mesh (an all-reduce's 2 (R-1)/R is its
  replica count's). With `target` the steps are compiled for it (deviceless), and what each
  collective may hide behind is read off its compiled schedule instead of the schemes' declared
  overlap_steps."""
  schemes = default_schemes(cfg) if schemes is None else schemes
  cfgs = [cfg, baseline(cfg)] + ([with_overrides(cfg, s.overrides) for s in schemes]
                                 if projection else [])
  measured = measure(cfgs, devices, target)
  text = format_report(_report(cfg, *measured[:2], target))
  if projection:
    per_param = {s.name: m["reduced"] / m["params"] for s, m in zip(schemes, measured[2:])}
    parts = {s.name: [(b / m["params"], times, window) for b, times, window in m["parts"]]
             for s, m in zip(schemes, measured[2:])} if target else None
    rows = project(per_param, overlap_steps={s.name: s.overlap_steps for s in schemes},
                   parts=parts)
    text += (f"\n\nbytes per parameter per step over {reduced_axis(cfg)}, measured: " +
             ", ".join(f"{name} {b:.3g}" for name, b in per_param.items()) + "\n" +
             format_projection(rows, target))
  return text


def exposed_s(parts, params: float, gbit: float, step_s: float) -> float:
  """Seconds per step a link of `gbit` Gbit/s adds to a step of `step_s` seconds of compute: each
  collective's transfer (`parts`: bytes per parameter per step, times it runs per step, steps of
  matmul work the schedule runs while it is in flight, as measure's "parts" over params) less the
  compute beside it, never below zero."""
  out = 0.0
  for per_param, times, window in parts:
    if times:
      out += times * max(0.0, per_param * params * 8 / (gbit * 1e9) / times - window * step_s)
  return out


# ---- a model of what the bytes cost between replicas on slow links: stated, not measured ----


def project(bytes_per_param_per_step: dict[str, float], models=PROJECTION_MODELS,
            bandwidths_gbit=(1, 10, 100), *, overlap_steps: dict[str, float] | None = None,
            mfu: float = 0.4, peak_flops: float = H200_BF16_FLOPS,
            step_time_s: dict[str, float] | None = None,
            tokens_per_replica_step: int | None = None,
            parts: dict[str, list] | None = None) -> list[dict]:
  """Projected compute utilization of each scheme for each model config and link bandwidth. A model:

  a replica is one GPU (`peak_flops`, default H200 dense bf16) running the config's batch per step,
  so T = 6 N tokens / (peak_flops x mfu) unless `step_time_s[model]` gives a measured step time; a
  replica sends bytes_per_param_per_step[scheme] x N bytes per optimizer step at the link's
  bandwidth, of which `overlap_steps[scheme]` x T hide behind compute (or, given `parts[scheme]`,
  measure's per-collective parts from a compiled schedule: exposed_s); utilization = T / (T +
  exposed)."""
  rows = []
  for model in models:
    cfg = config_files.load_config_file(f"configs/{model}.py")
    n = param_count(ModelConfig.from_config(cfg.model))
    tokens = tokens_per_replica_step or cfg.train.batch_size * cfg.train.seq_len
    t = (step_time_s or {}).get(model) or 6 * n * tokens / (peak_flops * mfu)
    for scheme, per_param in bytes_per_param_per_step.items():
      for gbit in bandwidths_gbit:
        comm = per_param * n * 8 / (gbit * 1e9)
        if parts and scheme in parts:
          exposed = exposed_s(parts[scheme], n, gbit, t)
        else:
          exposed = max(0.0, comm - (overlap_steps or {}).get(scheme, 0.0) * t)
        rows.append({
            "scheme": scheme, "model": model, "gbit": gbit, "params": n, "compute_s": t,
            "comm_s": comm, "exposed_s": exposed, "utilization": t / (t + exposed)
        })
  return rows


def format_projection(rows: list[dict], target: str | None = None) -> str:
  """A markdown table: a row per scheme, a column per model x bandwidth, utilization in percent."""
  columns = list(dict.fromkeys((r["model"], r["gbit"]) for r in rows))
  cell = {(r["scheme"], r["model"], r["gbit"]): r["utilization"] for r in rows}
  hidden = (f"the compute {target}'s compiled schedule runs beside each transfer" if target else
            "overlap x T")
  lines = ["Projected compute utilization (a model, not a measurement: T = 6 N tokens / "
           "(peak x mfu) per step, comm = bytes x 8 / bandwidth, utilization = T / "
           f"(T + max(0, comm - {hidden})))", "",
           "| scheme | " + " | ".join(f"{m} {g:g} Gbit/s" for m, g in columns) + " |",
           "|---|" + "---:|" * len(columns)]
  for scheme in dict.fromkeys(r["scheme"] for r in rows):
    lines.append(f"| {scheme} | " + " | ".join(f"{cell[scheme, m, g]:.1%}" for m, g in columns) +
                 " |")
  steps = {r["model"]: (r["params"], r["compute_s"]) for r in rows}
  lines += [
      "", "; ".join(f"{m}: N = {n / 1e6:,.0f}M, T = {t:.3g} s" for m, (n, t) in steps.items())
  ]
  return "\n".join(lines)
