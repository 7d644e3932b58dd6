"""The final metrics of training runs side by side, with the config keys in which the runs differ.

  python tools/compare_runs.py WORKDIR [WORKDIR ...] [--keys loss,eval_loss,...] [--format md]

Columns (--keys, in order; default all of these):
  step            the last logged step
  loss            the training loss at that step
  loss_gap        loss - entropy_floor (the synthetic language's floor), when logged
  best_eval_loss  the lowest eval_loss; eval_loss: the last one
  eval_gap        the last eval_loss - eval_entropy_floor, when logged
  tokens_per_sec  medians over the rows timed on training alone: not the first after a start or a
  mfu             restore (compilation), nor those holding an evaluation (tools/runs.py: timed_rows)
  goodput, goodput_productive_s, badput_compile_s, badput_checkpoint_s, badput_restore_s, badput_eval_s,
  badput_lost_s, lost_steps, joules_per_token, cost_per_mtok
                  the job's totals at its end (train/goodput.py), shown by default when a run logged them
  any other logged metric (grad_norm, lr, ...): its value at the last step that logs it.
Then one column per config.json key whose value differs between the runs ("-": not in that run)."""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's jaxtrain and tools, not an installed copy
  sys.path.insert(0, ROOT)

from tools.runs import Parser, Run, RunError, fail, load_runs, series  # noqa: E402

MISSING = "-"


def _last(run: Run, key: str):
  return (series(run.rows, key)[1] or [None])[-1]


def _gap(run: Run, key: str, floor: str):
  """`key` - `floor` at the last step that logs both."""
  rows = [{"step": r["step"], "gap": r[key] - r[floor]} for r in run.rows
          if r.get(key) is not None and r.get(floor) is not None]
  return (series(rows, "gap")[1] or [None])[-1]


def _median(rows: list[dict], key: str):
  values = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(values) if values else None


def _final(run: Run, key: str):
  """`key` of the job's goodput totals at its end (the `goodput` event, after the final save), else of its last
  step row."""
  final = getattr(run, "final", None) or {}
  return final.get(key, _last(run, key))


def final_goodput(workdir: str) -> dict:
  """The newest `goodput` event row of a workdir ({} when none)."""
  from jaxtrain.metrics import read_metrics
  return next((r for r in reversed(read_metrics(workdir)) if r.get("event") == "goodput"), {})


# name -> (the run's value or None, its format); grep-able, in the default column order
COLUMNS = {
    "step": (lambda run: _last(run, "step"), "{:d}"),
    "loss": (lambda run: _last(run, "loss"), "{:.4f}"),
    "loss_gap": (lambda run: _gap(run, "loss", "entropy_floor"), "{:.4f}"),
    "best_eval_loss": (lambda run: min(series(run.rows, "eval_loss")[1], default=None), "{:.4f}"),
    "eval_loss": (lambda run: _last(run, "eval_loss"), "{:.4f}"),
    "eval_gap": (lambda run: _gap(run, "eval_loss", "eval_entropy_floor"), "{:.4f}"),
    "tokens_per_sec": (lambda run: _median(run.timed, "tokens_per_sec"), "{:,.0f}"),
    "mfu": (lambda run: _median(run.timed, "mfu"), "{:.2%}"),
    "goodput": (lambda run: _final(run, "goodput"), "{:.1%}"),
    "goodput_productive_s": (lambda run: _final(run, "goodput_productive_s"), "{:.2f}"),
    "badput_compile_s": (lambda run: _final(run, "badput_compile_s"), "{:.2f}"),
    "badput_checkpoint_s": (lambda run: _final(run, "badput_checkpoint_s"), "{:.2f}"),
    "badput_restore_s": (lambda run: _final(run, "badput_restore_s"), "{:.2f}"),
    "badput_eval_s": (lambda run: _final(run, "badput_eval_s"), "{:.2f}"),
    "badput_lost_s": (lambda run: _final(run, "badput_lost_s"), "{:.2f}"),
    "lost_steps": (lambda run: _final(run, "lost_steps"), "{:.0f}"),
    "joules_per_token": (lambda run: _final(run, "joules_per_token"), "{:.3g}"),
    "cost_per_mtok": (lambda run: _final(run, "cost_per_mtok"), "{:.4g}"),
}
# shown by default only when some run logged them (runs from before goodput, or off GPUs for energy, lack them)
OPTIONAL = ("goodput", "goodput_productive_s", "badput_compile_s", "badput_checkpoint_s", "badput_restore_s",
            "badput_eval_s", "badput_lost_s", "lost_steps", "joules_per_token", "cost_per_mtok")


def compare(workdirs: list[str], keys: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
  """(header, one row of cells per run): the run's name, `keys` (default: COLUMNS, the OPTIONAL ones when a run
  logged them; or logged metrics), then the config keys that differ."""
  runs = load_runs(workdirs)
  for run, workdir in zip(runs, workdirs):
    run.final = final_goodput(workdir)
  if keys is None:
    keys = [k for k in COLUMNS if k not in OPTIONAL or any(metric_cell(run, k) != MISSING for run in runs)]
  for key in keys:
    if key not in COLUMNS and not any(series(run.rows, key)[0] for run in runs):
      base = ", ".join(k for k in COLUMNS if k not in OPTIONAL)
      raise RunError(f"--keys: no run logged {key!r} (columns: {base}, or any logged metric)")
  configs = [flatten(run.config) if run.config is not None else None for run in runs]
  differ = config_differences(configs)
  rows = [[run.name] + [metric_cell(run, key) for key in keys]
          + [config_cell(config, key) for key in differ] for run, config in zip(runs, configs)]
  return ["run", *keys, *differ], rows


def metric_cell(run: Run, key: str) -> str:
  value_of, fmt = COLUMNS.get(key, (lambda r: _last(r, key), "{:.4g}"))
  value = value_of(run)
  if value is None:
    return MISSING
  return fmt.format(value) if isinstance(value, (int, float)) else json.dumps(value)  # lists: per-expert loads


def flatten(config: dict, prefix: str = "") -> dict:
  """{"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def config_differences(configs: list[dict | None]) -> list[str]:
  """The keys, in first-seen order, whose values are not all equal over the runs with a config."""
  known = [c for c in configs if c is not None]
  keys = list(dict.fromkeys(k for c in known for k in c))
  return [k for k in keys if any(c.get(k, MISSING) != known[0].get(k, MISSING) for c in known)]


def config_cell(config: dict | None, key: str) -> str:
  if config is None or key not in config:
    return MISSING
  value = config[key]
  if isinstance(value, str):
    return value or '""'
  if isinstance(value, float):
    return f"{value:g}"
  return json.dumps(value)


def format_table(header: list[str], rows: list[list[str]], fmt: str = "text") -> str:
  """Aligned text (names left, values right, a dashed rule under the header) or a Markdown table."""
  if fmt == "md":
    rule = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join(_md_line(cells) for cells in [header, rule, *rows])
  widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]
  rule = ["-" * w for w in widths]
  return "\n".join(_text_line(cells, widths) for cells in [header, rule, *rows])


def _md_line(cells: list[str]) -> str:
  return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _text_line(cells: list[str], widths: list[int]) -> str:
  padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
  return "  ".join(padded).rstrip()


def main(argv=None) -> int:
  parser = Parser(prog="compare_runs.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="training workdirs (DIR/metrics.jsonl)")
  parser.add_argument("--keys", default=None, help="comma-separated columns (see the module doc)")
  parser.add_argument("--format", choices=("text", "md"), default="text", help="aligned text or Markdown")
  args = parser.parse_args(argv)
  keys = None if args.keys is None else [k for k in args.keys.split(",") if k]
  if keys == []:
    fail("compare_runs.py: --keys: give at least one column")
  try:
    print(format_table(*compare(args.workdirs, keys), args.format))
  except RunError as e:
    fail(f"compare_runs.py: {e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
