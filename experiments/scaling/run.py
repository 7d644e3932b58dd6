"""Scaling on this machine: tokens/s, memory and time to a fixed loss as the model grows ~10x twice
(tiny -> small_20m -> base_100m) and as devices grow 1 -> 2 -> 4 -> 8, against the planner's prediction.

  python experiments/scaling/run.py [--quick] [--root DIR] [--out DIR] [--start_over]

Sets 8 virtual CPU devices itself, before jax is imported. Each point trains from scratch with
`jaxtrain.train` (devices=jax.devices()[:n], data parallel) in --root/NAME; a point whose metrics already
reach its last step is read back, not retrained (--start_over retrains all). For each point: the train
step compiled as the loop compiles it, on abstract state (`memory_analysis()` per device: arguments +
outputs - aliased + temporaries), the process's peak RSS sampled during the run, the median step time
(steps after the first, which compiles), and the steps and seconds until the running mean of the loss
reaches config.TARGET. With `jaxtrain.plan` importable, `plan.predict(cfg, n_devices, "cpu")`'s memory
and step time, and measured / predicted; otherwise those columns are "-". Writes results.json, table.md,
scaling.png and curves.png (tools/plot_metrics.py) to --out (default: this folder for the full study,
which also rewrites README.md's tables between the markers; --quick: the runs' folder).
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import threading
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain and tools, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain.model.transformer import param_count  # noqa: E402
from jaxtrain.plan.compiled import compiled_memory as plan_compiled_memory  # noqa: E402
from tools.compare_runs import compare, format_table as compare_table  # noqa: E402
from tools.plot_metrics import plot  # noqa: E402

MARKERS = ("<!-- results:begin -->", "<!-- results:end -->")
MISSING = "-"


def load_study_config():
  """This folder's config.py as a module (its get_config, ARGS, DEVICES, TARGET, ...)."""
  spec = importlib.util.spec_from_file_location("scaling_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_planner():
  """jaxtrain.plan (the tests put a fake in its place, or None for a table without the planner's columns)."""
  import jaxtrain.plan as plan_lib  # noqa: PLC0415
  return plan_lib


def machine() -> dict:
  """Where and when: date, CPU, cores, jax version, load average at the call."""
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
             "unknown") if os.path.isfile("/proc/cpuinfo") else platform.processor()
  return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
          "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
          "load_average": [round(x, 1) for x in os.getloadavg()]}


def compiled_memory(cfg, devices) -> dict:
  """Per-device bytes of the train step as the loop compiles it, on abstract state and batch (the planner's
  reference, jaxtrain/plan/compiled.py): memory_analysis()'s arguments, outputs, aliased, temporaries, total."""
  m = plan_compiled_memory(cfg, devices)
  return {"arguments": m["argument"], "outputs": m["output"], "aliased": m["alias"], "temporaries": m["temp"],
          "total": m["total"]}


class PeakRss:
  """The process's peak resident set size while the block runs, sampled every 50 ms from /proc."""

  def __enter__(self):
    self.peak, self._stop = rss(), threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.05):
      self.peak = max(self.peak, rss())

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, rss())


def rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def finished(workdir: str, steps: int) -> bool:
  if not os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
    return False
  return any(r.get("step") == steps and "loss" in r for r in jaxtrain.read_metrics(workdir, as_frame=False))


def timed(rows: list[dict]) -> list[dict]:
  """The rows whose step_time_s times a step: not the first (compilation), nor the last, logged after the
  loop (with sync_every_step its window holds no step)."""
  return rows[1:-1] if len(rows) > 2 else rows[1:]


def time_to_target(rows: list[dict], median: float, target: float, smooth: int):
  """(steps, seconds) until the running mean of `smooth` losses first is <= target, or (None, None). The
  seconds add each step's time, the first step's (compilation) counted as the median step."""
  losses = [r["loss"] for r in rows]
  for k in range(smooth, len(losses) + 1):
    if statistics.fmean(losses[k - smooth:k]) <= target:
      return rows[k - 1]["step"], median + sum(r["step_time_s"] for r in rows[1:k])
  return None, None


def run_point(name: str, cfg, n_devices: int, workdir: str, study, start_over: bool, planner) -> dict:
  """Trains (or reads back) one point and measures it."""
  devices = jax.devices()[:n_devices]
  config_lib.validate(cfg, n_devices)
  memory = compiled_memory(cfg, devices)
  rss_file = os.path.join(workdir, "peak_rss.json")  # measured while training, kept for a read-back
  if start_over or not finished(workdir, cfg.train.steps):
    with PeakRss() as peak:
      jaxtrain.train(cfg, workdir, devices=devices, progress=False, sync_every_step=True, start_over=True)
    with open(rss_file, "w") as f:
      json.dump({"peak_rss": peak.peak}, f)
  peak_rss = json.load(open(rss_file))["peak_rss"] if os.path.isfile(rss_file) else None
  rows = [r for r in jaxtrain.read_metrics(workdir, as_frame=False) if "event" not in r and "loss" in r]
  median = statistics.median(r["step_time_s"] for r in timed(rows))
  tokens = cfg.train.batch_size * cfg.train.seq_len
  steps_to, time_to = time_to_target(rows, median, study.TARGET, study.SMOOTH)
  point = {"name": name, "devices": n_devices, "params": param_count(config_lib.ModelConfig.from_config(cfg.model)),
           "tokens_per_step": tokens, "steps": cfg.train.steps, "median_step_s": median,
           "tokens_per_sec": tokens / median, "first_step_s": rows[0]["step_time_s"], "memory": memory,
           "peak_rss": peak_rss, "final_loss": rows[-1]["loss"], "steps_to_target": steps_to,
           "time_to_target_s": time_to, "curve": [(r["step"], r["loss"], r["step_time_s"]) for r in rows],
           "workdir": os.path.relpath(workdir, ROOT), "predicted": None}
  if planner is not None:
    plan = planner.predict(cfg, n_devices=n_devices, device_kind="cpu")
    point["predicted"] = {"memory_total": plan.memory["total"], "step_time_s": plan.step_time_s}
  print(f"{name} x{n_devices}: {median:.3f} s/step, {tokens / median:,.0f} tokens/s, "
        f"{memory['total'] / 2**20:,.1f} MiB/device, to {study.TARGET}: {steps_to}", flush=True)
  return point


def ratio(measured, predicted) -> str:
  return f"{measured / predicted:.2f}" if predicted else MISSING


def mib(n) -> str:
  return f"{n / 2**20:,.1f}"


def format_table(points: list[dict], study, by: str) -> str:
  """One markdown table; `by` = "size" (first column the model) or "devices"."""
  head = ["model" if by == "size" else "devices", "params", "tokens/step", "step (median)", "tokens/s",
          "compiled MiB/device", "temp MiB/device", "peak RSS MiB", "planner MiB", "measured/planner mem",
          "planner step", "measured/planner step", f"steps to loss {study.TARGET}", f"time to loss {study.TARGET}",
          "final loss"]
  lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  for p in points:
    pred = p["predicted"] or {}
    reached = p["steps_to_target"] is not None
    cells = [p["name"] if by == "size" else str(p["devices"]), f"{p['params'] / 1e6:.2f}M", f"{p['tokens_per_step']:,}",
             f"{p['median_step_s']:.3f} s", f"{p['tokens_per_sec']:,.0f}", mib(p["memory"]["total"]),
             mib(p["memory"]["temporaries"]), mib(p["peak_rss"]) if p["peak_rss"] else MISSING,
             mib(pred["memory_total"]) if pred else MISSING, ratio(p["memory"]["total"], pred.get("memory_total")),
             f"{pred['step_time_s']:.3f} s" if pred else MISSING, ratio(p["median_step_s"], pred.get("step_time_s")),
             str(p["steps_to_target"]) if reached else f"not reached in {p['steps']} steps",
             f"{p['time_to_target_s']:.1f} s" if reached else MISSING, f"{p['final_loss']:.4f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def draw(sizes: list[dict], devices: list[dict], study, path: str):
  """Top: tokens/s, memory and loss against time by model size; bottom: the same by device count."""
  fig = Figure(figsize=(15, 8), dpi=100)
  FigureCanvasAgg(fig)
  for row, (points, x_key, x_label) in enumerate(((sizes, "params", "parameters"), (devices, "devices", "devices"))):
    x = [p[x_key] for p in points]
    speed, memory, loss = (fig.add_subplot(2, 3, 3 * row + i + 1) for i in range(3))
    speed.plot(x, [p["tokens_per_sec"] for p in points], "o-", label="measured")
    memory.plot(x, [p["memory"]["total"] / 2**20 for p in points], "o-", label="compiled, per device")
    if all(p["peak_rss"] for p in points):
      memory.plot(x, [p["peak_rss"] / 2**20 for p in points], "s:", label="peak RSS, process")
    if all(p["predicted"] for p in points):
      speed.plot(x, [p["tokens_per_step"] / p["predicted"]["step_time_s"] for p in points], "x--", label="planner")
      memory.plot(x, [p["predicted"]["memory_total"] / 2**20 for p in points], "x--", label="planner")
    for ax in (speed, memory):
      ax.set_xscale("log", base=2 if row else 10)
      ax.set_yscale("log")
      ax.set_xlabel(x_label)
      ax.legend()
    speed.set(ylabel="tokens/s", title=f"throughput by {x_label}")
    memory.set(ylabel="MiB", title=f"memory by {x_label}")
    for p in points:
      seconds = np.cumsum([p["median_step_s"]] + [c[2] for c in p["curve"][1:]])
      label = p["name"] if row == 0 else f"{p['devices']} device" + ("s" if p["devices"] > 1 else "")
      loss.plot(seconds, [c[1] for c in p["curve"]], label=label)
    loss.axhline(study.TARGET, color="gray", ls="--", lw=0.8, label=f"target {study.TARGET}")
    loss.set(xlabel="seconds of steps (first step counted as the median)", ylabel="training loss",
             title="loss against time")
    loss.legend()
  fig.tight_layout()
  fig.savefig(path)


def rewrite_readme(block: str):
  path = os.path.join(HERE, "README.md")
  text = open(path).read()
  begin, end = MARKERS
  head, rest = text.split(begin, 1)
  with open(path, "w") as f:
    f.write(head + begin + "\n" + block + "\n" + end + rest.split(end, 1)[1])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="d_model <= 64 stand-ins, 3 steps (the test)")
  parser.add_argument("--root", default="", help="where the workdirs go (default: runs/ beside this file)")
  parser.add_argument("--out", default="", help="where the tables and plots go (see above)")
  parser.add_argument("--start_over", action="store_true", help="retrain points that already finished")
  args = parser.parse_args(argv)
  study = load_study_config()
  steps, device_steps = (3, 3) if args.quick else (study.STEPS, study.DEVICE_STEPS)
  root = args.root or os.path.join(HERE, "runs", "quick" if args.quick else "full")
  out = args.out or (root if args.quick else HERE)
  os.makedirs(out, exist_ok=True)
  planner = load_planner()
  results = {"machine": machine(), "command": "python experiments/scaling/run.py" + (" --quick" if args.quick else ""),
             "quick": args.quick, "target": study.TARGET, "smooth": study.SMOOTH, "planner": planner is not None}
  print(results["machine"], flush=True)
  start = time.perf_counter()
  model = study.DEVICE_MODEL
  results["devices"] = [run_point(model, study.get_config(model, device_steps, args.quick, True), n,
                                  os.path.join(root, f"{model}_x{n}"), study, args.start_over, planner)
                        for n in (study.QUICK_DEVICES if args.quick else study.DEVICES)]
  results["sizes"] = [run_point(name, study.get_config(name, steps, args.quick), 1, os.path.join(root, name), study,
                                args.start_over, planner) for name in study.ARGS]
  results["wall_s"] = time.perf_counter() - start
  results["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
  tables = (format_table(results["sizes"], study, "size") + "\n\n" + format_table(results["devices"], study, "devices"))
  workdirs = [os.path.join(ROOT, p["workdir"]) for p in results["sizes"]]
  compared = format_table_runs(workdirs)
  print(tables + "\n\n" + compared, flush=True)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(tables + "\n\n" + compared + "\n")
  draw(results["sizes"], results["devices"], study, os.path.join(out, "scaling.png"))
  plot(workdirs, os.path.join(out, "curves.png"))
  if out == HERE:
    m = results["machine"]
    planned = "`jaxtrain.plan.predict(cfg, n, 'cpu')`" if planner else "none, columns -"
    rewrite_readme(f"Measured {m['date']} on {m['cpu']}, {m['cores']} cores, jax {m['jax']}, Python {m['python']}; "
                   f"load average {m['load_average']} at the start and {results['load_average_end']} at the end "
                   f"(the machine is shared). `{results['command']}` took {results['wall_s'] / 60:.1f} min "
                   f"(finished points read back, not retrained). Planner: "
                   f"{planned}.\n\n"
                   f"By model size (1 device, {steps} steps of {results['sizes'][0]['tokens_per_step']} tokens):\n\n"
                   f"{format_table(results['sizes'], study, 'size')}\n\n"
                   f"By devices ({study.DEVICE_MODEL}, {device_steps} steps of "
                   f"{results['devices'][0]['tokens_per_step']:,} tokens, data parallel):\n\n"
                   f"{format_table(results['devices'], study, 'devices')}\n\n`tools/compare_runs.py` on the sizes:\n\n"
                   f"{compared}")
  print(f"wrote {out}", flush=True)
  return results


def format_table_runs(workdirs: list[str]) -> str:
  """tools/compare_runs.py's table of the runs."""
  return compare_table(*compare(workdirs, ["step", "loss", "tokens_per_sec", "mfu"]), "md")


if __name__ == "__main__":
  # The memory compile and the training run's compile are the same program: the second is read back.
  jax.config.update("jax_compilation_cache_dir", os.path.join(HERE, "runs", "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  main()
