"""Reads each seed's metrics.jsonl (jaxtrain.read_metrics) and control.json; writes results.json, results.md and
accuracy.png beside this file.

  python experiments/evaluation/analyze.py [--root runs/evaluation]

Every number comes with its noise: the mean over seeds +- the standard deviation over seeds (ddof=1), and
beside it the binomial standard error of one run's accuracy over the task's docs (sqrt(p(1-p)/(n-1)), the
`acc_stderr` that jaxtrain logs, as lm-evaluation-harness computes it), averaged over the seeds. Bits per
byte: the spread over seeds and a bootstrap over the task's docs is not logged, so only the seed spread."""

import argparse
import glob
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jaxtrain  # noqa: E402

MC_TASKS = ("next_line", "next_indent")
CONTROLS = {"next_line": "next_line_control", "next_indent": "next_indent_control"}
BPB = "json_bpb"
CHANCE = 0.25


def by_step(workdir: str) -> dict[int, dict]:
  """{step: the merged metrics rows of that step}."""
  out = {}
  for row in jaxtrain.read_metrics(workdir, as_frame=False):
    if "step" in row:
      out.setdefault(int(row["step"]), {}).update(row)
  return out


def stats(values) -> dict:
  v = np.asarray(values, np.float64)
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": int(len(v)),
          "values": [float(x) for x in v]}


def pct(s: dict, se: float | None = None) -> str:
  text = f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f}"
  return text + (f" (SE {100 * se:.1f})" if se is not None else "")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=os.path.join(ROOT, "runs", "evaluation"))
  args = parser.parse_args()
  workdirs = sorted(glob.glob(os.path.join(args.root, "seed_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
  workdirs = [w for w in workdirs if os.path.exists(os.path.join(w, "control.json"))]  # finished runs only
  runs = {os.path.basename(w): by_step(w) for w in workdirs}
  controls = {os.path.basename(w): json.load(open(os.path.join(w, "control.json")))
              for w in workdirs if os.path.exists(os.path.join(w, "control.json"))}
  key = f"eval/{MC_TASKS[0]}/acc"
  steps = sorted(set.intersection(*[{s for s, r in rows.items() if key in r} for rows in runs.values()]))
  docs = {t: int(next(iter(runs.values()))[steps[-1]][f"eval/{t}/docs"]) for t in (*MC_TASKS, BPB)}

  curves = {}
  for task in MC_TASKS:
    for metric in ("acc", "acc_norm"):
      curves[f"{task}/{metric}"] = [
          {"step": s, **stats([rows[s][f"eval/{task}/{metric}"] for rows in runs.values()]),
           "binomial_se": float(np.mean([rows[s][f"eval/{task}/{metric}_stderr"] for rows in runs.values()]))}
          for s in steps]
  curves[f"{BPB}/bits_per_byte"] = [
      {"step": s, **stats([rows[s][f"eval/{BPB}/bits_per_byte"] for rows in runs.values()])} for s in steps]
  loss_steps = sorted(set.intersection(*[{s for s, r in rows.items() if "eval_loss" in r} for rows in runs.values()]))
  curves["eval_loss"] = [{"step": s, **stats([rows[s]["eval_loss"] for rows in runs.values()])} for s in loss_steps]

  # the last step against the first evaluation and against the shuffled-context control, paired by seed
  first, last = steps[0], steps[-1]
  final = {}
  for task in MC_TASKS:
    for metric in ("acc", "acc_norm"):
      at = lambda s: [rows[s][f"eval/{task}/{metric}"] for rows in runs.values()]  # noqa: E731
      entry = {"first": stats(at(first)), "last": stats(at(last)),
               "rise": stats(np.array(at(last)) - np.array(at(first)))}
      if len(controls) == len(runs):
        ctrl = [controls[name]["tasks"][CONTROLS[task]][metric] for name in runs]
        entry["control"] = stats(ctrl)
        entry["control_binomial_se"] = float(np.mean(
            [controls[name]["tasks"][CONTROLS[task]][f"{metric}_stderr"] for name in runs]))
        entry["over_control"] = stats(np.array(at(last)) - np.array(ctrl))
      final[f"{task}/{metric}"] = entry

  # cost: the in-loop evaluations' time (eval/time_s of each evaluated row; goodput's eval badput in all)
  cost = {}
  for name, rows in runs.items():
    last_row = rows[max(rows)]
    cost[name] = {"evals": len(steps), "eval_s_each": float(np.median([rows[s]["eval/time_s"] for s in steps])),
                  "badput_eval_s": float(last_row.get("badput_eval_s", math.nan)),
                  "productive_s": float(last_row.get("goodput_productive_s", math.nan)),
                  "job_wall_s": float(last_row.get("goodput_wall_s", math.nan)),
                  "step_time_s": float(np.median([r["step_time_s"] for r in rows.values() if "step_time_s" in r])),
                  "truncated": {t: int(last_row.get(f"eval/{t}/truncated", 0)) for t in MC_TASKS},
                  **({"train_wall_s": controls[name]["train_wall_s"], "control_wall_s": controls[name]["control_wall_s"]}
                     if name in controls else {})}
  results = {"seeds": list(runs), "steps": steps, "docs": docs, "chance": CHANCE, "curves": curves,
             "final": final, "cost": cost}
  with open(os.path.join(HERE, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  write_markdown(results)
  plot(results)
  print(open(os.path.join(HERE, "results.md")).read())


def write_markdown(r: dict) -> None:
  n, c = len(r["seeds"]), r["curves"]
  lines = [f"# Results ({n} seeds: {', '.join(r['seeds'])})", "",
           f"Accuracy in %: mean ± std over the {n} seeds, and (SE x) the binomial standard error of one run's "
           f"accuracy over the task's {r['docs']['next_line']} docs, averaged over the seeds. Chance: "
           f"{100 * r['chance']:.0f}%. Bits per byte over json/ ({r['docs'][BPB]} docs): mean ± std over seeds.", "",
           "| step | next_line acc | next_line acc_norm | next_indent acc | next_indent acc_norm | json bits/byte |",
           "| ---: | ---: | ---: | ---: | ---: | ---: |"]
  for i, step in enumerate(r["steps"]):
    cells = [pct(c[f"{t}/{m}"][i], c[f"{t}/{m}"][i]["binomial_se"]) for t in MC_TASKS for m in ("acc", "acc_norm")]
    b = c[f"{BPB}/bits_per_byte"][i]
    lines.append(f"| {step} | " + " | ".join(cells) + f" | {b['mean']:.3f} ± {b['std']:.3f} |")
  lines += ["", "Held-out loss of the training distribution (2% of the top-level files; nats/byte), mean ± std:", "",
            "| step | eval_loss |", "| ---: | ---: |"]
  lines += [f"| {e['step']} | {e['mean']:.3f} ± {e['std']:.3f} |" for e in c["eval_loss"]]
  lines += ["", f"At the last step (paired by seed; rise = last - first evaluation at step {r['steps'][0]}; control = the "
            "same choices after another doc's context, scored by the last checkpoint):", "",
            "| task/metric | last | rise since first | control | last - control |",
            "| --- | ---: | ---: | ---: | ---: |"]
  for name, e in r["final"].items():
    ctrl = pct(e["control"], e["control_binomial_se"]) if "control" in e else "-"
    over = pct(e["over_control"]) if "over_control" in e else "-"
    lines.append(f"| {name} | {pct(e['last'])} | {pct(e['rise'])} | {ctrl} | {over} |")
  lines += ["", "Cost per run (seconds; eval each = the median in-loop evaluation of all three tasks):", "",
            "| seed | step time | productive | evals x eval each | eval badput | job wall | truncated |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for name, e in r["cost"].items():
    lines.append(f"| {name} | {e['step_time_s']:.3f} | {e['productive_s']:.0f} | {e['evals']} x {e['eval_s_each']:.1f} | "
                 f"{e['badput_eval_s']:.0f} | {e['job_wall_s']:.0f} | {sum(e['truncated'].values())} |")
  with open(os.path.join(HERE, "results.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def plot(r: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for ax, task in zip(axes, MC_TASKS):
    for metric, color in (("acc", "C0"), ("acc_norm", "C1")):
      curve = r["curves"][f"{task}/{metric}"]
      steps = [e["step"] for e in curve]
      mean = np.array([e["mean"] for e in curve]) * 100
      std = np.array([e["std"] for e in curve]) * 100
      se = np.array([e["binomial_se"] for e in curve]) * 100
      ax.plot(steps, mean, color=color, marker=".", label=f"{metric} (mean of {len(r['seeds'])} seeds)")
      ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.25, label=f"{metric} ± std over seeds")
      ax.errorbar(steps, mean, yerr=se, fmt="none", ecolor=color, alpha=0.6, capsize=2)
      ctrl = r["final"][f"{task}/{metric}"].get("control")
      if ctrl:
        ax.axhline(100 * ctrl["mean"], color=color, ls=":", lw=1, label=f"{metric}, shuffled-context control")
    ax.axhline(100 * r["chance"], color="k", ls="--", lw=1, label="chance (25%)")
    ax.set(title=f"{task} ({r['docs'][task]} docs; bars: binomial SE)", xlabel="step", ylabel="accuracy (%)")
    ax.legend(fontsize=7)
  curve = r["curves"][f"{BPB}/bits_per_byte"]
  steps = [e["step"] for e in curve]
  mean, std = np.array([e["mean"] for e in curve]), np.array([e["std"] for e in curve])
  axes[2].plot(steps, mean, color="C2", marker=".", label="mean")
  axes[2].fill_between(steps, mean - std, mean + std, color="C2", alpha=0.25, label="± std over seeds")
  axes[2].set(title=f"{BPB}: held-out json/ sources", xlabel="step", ylabel="bits per byte")
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, "accuracy.png"), dpi=110)


if __name__ == "__main__":
  main()
