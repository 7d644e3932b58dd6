"""Training curves with matplotlib: `jaxtrain.plot(workdir)` in a notebook; tools/plot_metrics.py
draws the same panels (`draw_panel`) into a PNG. A reader of metrics.jsonl like the tools: it
imports only jaxtrain.metrics."""

import dataclasses
import os

from jaxtrain.metrics import read_metrics

# metric -> (panel title, the metric holding its floor or None)
PANELS = {"loss": ("training loss", "entropy_floor"),
          "eval_loss": ("eval loss", "eval_entropy_floor"),
          "tokens_per_sec": ("tokens/s (rows without compilation or eval)", None),
          "mfu": ("MFU (rows without compilation or eval)", None)}
TIMED = {"tokens_per_sec", "mfu"}  # drawn over timed_rows only


@dataclasses.dataclass
class Curves:
  name: str
  rows: list[dict]  # every step row of metrics.jsonl in file order (checkpoint events left out)
  timed: list[dict]  # the rows whose step time is training alone (timed_rows)


def curves(workdir: str, name: str | None = None) -> Curves:
  """The logged steps of the run in `workdir`, named by its directory unless `name` is given."""
  raw = read_metrics(workdir)
  rows = [r for r in raw if "event" not in r and "step" in r]
  return Curves(name or os.path.basename(os.path.normpath(workdir)), rows, timed_rows(raw))


def timed_rows(raw: list[dict]) -> list[dict]:
  """Step rows whose step time is training alone: not the first after a start or a restore (it
  includes compilation), nor one holding an evaluation (the loop counts eval time in that row)."""
  timed, fresh = [], True
  for row in raw:
    if row.get("event") == "checkpoint_restore":
      fresh = True
    elif "event" not in row and "step" in row:
      if not fresh and "eval_loss" not in row and "eval/time_s" not in row:
        timed.append(row)
      fresh = False
  return timed


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of `key` over the rows that log it, the newest row for a step that a resumed
  run logged again, in step order."""
  by_step = {r["step"]: r[key] for r in rows if r.get(key) is not None}
  steps = sorted(by_step)
  return steps, [by_step[s] for s in steps]


def plot(workdirs, keys=("loss", "eval_loss"), ax=None):
  """Draws `keys` against step, a panel per key and a line per run (`workdirs`: one workdir or
  several), the entropy floor dashed where the data logs one. `ax`: an Axes per key (one Axes for
  one key); by default a new pyplot figure (shown inline in a notebook). Returns the Figure."""
  workdirs = [workdirs] if isinstance(workdirs, (str, os.PathLike)) else list(workdirs)
  keys = (keys,) if isinstance(keys, str) else tuple(keys)
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  runs = [curves(w, n if names.count(n) == 1 else os.path.normpath(w))
          for w, n in zip(workdirs, names)]
  if ax is None:
    import matplotlib.pyplot as plt
    axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False,
                        layout="constrained")[1][0]
  else:
    axes = list(ax) if hasattr(ax, "__len__") else [ax]
    if len(axes) != len(keys):
      raise ValueError(f"plot: {len(axes)} axes for {len(keys)} keys {keys}; pass an Axes per key")
  for a, key in zip(axes, keys):
    title, floor = PANELS.get(key, (key, None))
    draw_panel(a, runs, key, title, floor)
  return axes[0].figure


def draw_panel(ax, runs, key: str, title: str, floor: str | None):
  """`key` against step, a line per run labelled by its name, then the floors (draw_floors). A run
  is anything with `name`, `rows` and `timed` (Curves, tools/runs.py's Run)."""
  from matplotlib.ticker import MaxNLocator, PercentFormatter
  drawn = []
  for run in runs:
    steps, values = series(run.timed if key in TIMED else run.rows, key)
    if steps:
      (line,) = ax.plot(steps, values, marker=".", markersize=4, label=run.name)
      drawn.append((run, line.get_color()))
  if floor:
    draw_floors(ax, drawn, floor)
  ax.set_title(title)
  ax.set_xlabel("step")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.grid(alpha=0.3)
  if key == "mfu":
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
  if ax.lines:
    ax.legend(fontsize="small")
  else:
    ax.text(0.5, 0.5, f"no run logged {key}", ha="center", va="center", transform=ax.transAxes)


def draw_floors(ax, drawn: list[tuple], floor: str):
  """A dashed line per distinct floor value (the last logged): in its run's colour when one run has
  it, grey when several share it (a sweep over one data config)."""
  by_value = {}
  for run, color in drawn:
    values = series(run.rows, floor)[1]
    if values:
      by_value.setdefault(values[-1], []).append((run.name, color))
  for value, owners in by_value.items():
    names = [name for name, _ in owners]
    label = f"{names[0]} floor" if len(owners) == 1 else f"floor of {', '.join(names)}"
    label = "floor of all runs" if len(owners) == len(drawn) > 1 else label
    ax.axhline(value, color=owners[0][1] if len(owners) == 1 else "grey", linestyle="--",
               linewidth=1, label=label)
