"""Training curves of one or more runs in one PNG, one line per run, x = step.

  python tools/plot_metrics.py WORKDIR [WORKDIR ...] --out plot.png

Panels: training loss and eval loss, each with its entropy floor as a dashed line where the data
logs one; tokens/s and MFU over the rows timed on training alone (tools/runs.py: timed_rows)."""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's jaxtrain and tools, not an installed copy
  sys.path.insert(0, ROOT)

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator, PercentFormatter  # noqa: E402

from tools.runs import Parser, RunError, fail, load_runs, series  # noqa: E402

# (metric, panel title, the metric holding its floor or None), in the axes' order: left to right, top to bottom
PANELS = (("loss", "training loss", "entropy_floor"),
          ("eval_loss", "eval loss", "eval_entropy_floor"),
          ("tokens_per_sec", "tokens/s (rows without compilation or eval)", None),
          ("mfu", "MFU (rows without compilation or eval)", None))
TIMED = {"tokens_per_sec", "mfu"}
FIGSIZE, DPI = (12, 8), 100  # a 1200 x 800 PNG


def plot(workdirs: list[str], out: str | None = None) -> Figure:
  """Draws the runs' panels (fig.axes in PANELS order) on the Agg canvas; writes a PNG to `out` when given."""
  runs = load_runs(workdirs)
  fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)
  for ax, (key, title, floor) in zip(fig.subplots(2, 2).flat, PANELS):
    draw_panel(ax, runs, key, title, floor)
  if out:
    fig.savefig(out)
  return fig


def draw_panel(ax, runs, key: str, title: str, floor: str | None):
  """`key` against step, a line per run labelled by its name, then the floors (draw_floors)."""
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
  """A dashed line per distinct floor value (the last logged): in its run's colour when one run has it,
  grey when several share it (a sweep over one data config)."""
  by_value = {}
  for run, color in drawn:
    values = series(run.rows, floor)[1]
    if values:
      by_value.setdefault(values[-1], []).append((run.name, color))
  for value, owners in by_value.items():
    names = [name for name, _ in owners]
    label = f"{names[0]} floor" if len(owners) == 1 else f"floor of {', '.join(names)}"
    label = "floor of all runs" if len(owners) == len(drawn) > 1 else label
    ax.axhline(value, color=owners[0][1] if len(owners) == 1 else "grey", linestyle="--", linewidth=1, label=label)


def main(argv=None) -> int:
  parser = Parser(prog="plot_metrics.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="training workdirs (DIR/metrics.jsonl)")
  parser.add_argument("--out", required=True, help="the PNG to write")
  args = parser.parse_args(argv)
  if not args.out.lower().endswith(".png"):
    fail(f"plot_metrics.py: --out {args.out}: expected a .png path")
  try:
    plot(args.workdirs, args.out)
  except (RunError, OSError) as e:
    fail(f"plot_metrics.py: {e}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
