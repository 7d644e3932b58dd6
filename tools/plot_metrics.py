"""Training curves of one or more runs in one PNG, one line per run, x = step.

  python tools/plot_metrics.py WORKDIR [WORKDIR ...] --out plot.png

Panels: training loss and eval loss, each with its entropy floor as a dashed line where the data
logs one; tokens/s and MFU over the rows timed on training alone (jaxtrain/plotting.py: timed_rows)."""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's jaxtrain and tools, not an installed copy
  sys.path.insert(0, ROOT)

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from jaxtrain.plotting import PANELS as TITLES, draw_panel  # noqa: E402  (the panels `jaxtrain.plot` draws)
from tools.runs import Parser, RunError, fail, load_runs  # noqa: E402

# (metric, panel title, the metric holding its floor or None), in the axes' order: left to right, top to bottom
PANELS = tuple((key, *TITLES[key]) for key in ("loss", "eval_loss", "tokens_per_sec", "mfu"))
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
