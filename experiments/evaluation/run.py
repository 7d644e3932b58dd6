"""Trains one run per seed in config.ARGS (one process at a time) with the in-loop tasks, scores the controls
at the last step, then runs analyze.py.

  python experiments/evaluation/run.py [--root runs/evaluation] [--seeds 0,1,2]

Each run: `jaxtrain.train` of config.py:SEED in ROOT/seed_SEED (from scratch), which logs eval/<task>/<metric>
every config.EVERY steps in its metrics.jsonl; then `jaxtrain.evaluate` of the final checkpoint on the
shuffled-context controls (tasks/*_control.jsonl), written to ROOT/seed_SEED/control.json with the wall
times. The tasks must exist (python experiments/evaluation/make_tasks.py writes them)."""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain, not an installed copy
  sys.path.insert(0, ROOT)

import jax  # noqa: E402

import jaxtrain  # noqa: E402


def load_study_config():
  """This folder's config.py as a module (its get_config, ARGS and task names)."""
  spec = importlib.util.spec_from_file_location("evaluation_config", os.path.join(HERE, "config.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=os.path.join(ROOT, "runs", "evaluation"), help="where the workdirs go")
  parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: config.ARGS)")
  args = parser.parse_args()
  study = load_study_config()
  seeds = args.seeds.split(",") if args.seeds else list(study.ARGS)
  print(f"{datetime.date.today()}, jax {jax.__version__}, {platform.python_version()}, {jax.devices()[0].device_kind}"
        f" x {jax.device_count()}, {os.cpu_count()} cores", flush=True)
  for seed in seeds:
    workdir = os.path.join(args.root, f"seed_{seed}")
    t0 = time.time()
    final = jaxtrain.train(study.get_config(seed), workdir, progress=False, start_over=True)
    train_s = time.time() - t0
    t0 = time.time()
    controls = jaxtrain.evaluate(workdir, [os.path.join(HERE, "tasks", f"{t}.jsonl") for t in study.CONTROLS])
    control_s = time.time() - t0
    with open(os.path.join(workdir, "control.json"), "w") as f:
      json.dump({"step": final["step"], "tasks": controls, "train_wall_s": train_s, "control_wall_s": control_s},
                f, indent=1)
    print(f"seed {seed}: step {final['step']}, loss {final['loss']:.4f}, "
          + ", ".join(f"{t} acc {final[f'eval/{t}/acc']:.4f}" for t in study.TASKS if f"eval/{t}/acc" in final)
          + ", " + ", ".join(f"{t} acc {m['acc']:.4f}" for t, m in controls.items())
          + f"; {train_s:.0f} s training, {control_s:.0f} s controls", flush=True)
  subprocess.run([sys.executable, os.path.join(HERE, "analyze.py"), "--root", args.root], check=True)


if __name__ == "__main__":
  main()
