"""LoRA against full fine-tuning on the chain's SFT (issue 25 item 4's quality gap).

Per seed, from the base step rm_chain.py chose on validation (its results.json; the bases are
rl_must_win.py's): SFT on the same 200 clean problems (carries included) for 100 steps, full
fine-tuning at the chain's lr (3e-3) against LoRA (`model.lora_rank`, every weight, alpha 16) at
each lr of LORA_LRS; every run's step and LoRA's lr chosen on the validation prompts, test accuracy
reported at that choice.

  python experiments/posttrain/lora_gap.py [--seeds 0,1,2] [--rank 8]
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"posttrain_{name}", os.path.join(HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


WIN = _load("rl_must_win")
RUN = WIN.RUN
LORA_LRS = (3e-3, 1e-2, 3e-2)


def run_seed(out: str, b: dict, seed: int, base_step: int, rank: int) -> dict:
  s = WIN.splits(b, seed, carry_in_sft=True)
  d = os.path.join(out, f"lora_gap_seed{seed}")
  scores = WIN.scorer(s, b["rl_new_tokens"])
  base_cfg, base_dir, _ = RUN.train_base(out, {**b, "base_every": b["chain_base_every"]}, False, seed,
                                         noise=b["chain_noise"])
  sft_path = RUN.write_jsonl([{"prompt": r["prompt"], "completion": r["completion"]} for r in s["sft"]],
                             os.path.join(d, "sft.jsonl"))
  val_path = RUN.write_jsonl([{"prompt": r["prompt"], "completion": r["answer"]} for r in s["val"]],
                             os.path.join(d, "val_sft.jsonl"))
  start = RUN.keep_step(base_dir, base_step, os.path.join(d, "base_start"))
  every = b["chain_sft_every"]
  runs = {}
  for name, lr, lora in [("full", b["chain_sft_lr"], False)] + [(f"lora_lr{lr:g}", lr, True) for lr in LORA_LRS]:
    c = RUN.sft_config(base_cfg, sft_path, val_path, start, b["chain_sft_steps"], {**b, "sft_lr": lr})
    c.checkpoint.update(every_steps=every, keep_every_steps=every)
    if lora:
      c.model.update(lora_rank=rank, lora_alpha=16.0, lora_targets=".*")
    workdir = os.path.join(d, name)
    train_s = RUN.sft(c, workdir)
    curve = [scores(workdir, k) for k in range(every, b["chain_sft_steps"] + 1, every)]
    best = max(curve, key=lambda x: (x["val"], -x["step"]))
    runs[name] = {"lr": lr, "lora": lora, "curve": curve, "best": best, "train_s": train_s}
    print(json.dumps({"seed": seed, "run": name, "best": best, "train_s": train_s}), flush=True)
  lora_best = max((r for r in runs.values() if r["lora"]), key=lambda r: (r["best"]["val"], -r["lr"]))
  return {"seed": seed, "base_step": base_step, "runs": runs, "full": runs["full"]["best"],
          "lora": {**lora_best["best"], "lr": lora_best["lr"]},
          "gap_points": round(100 * (lora_best["best"]["test"] - runs["full"]["best"]["test"]), 1)}


def table(r: dict) -> str:
  pct = lambda v: f"{100 * v:.1f}%"
  lines = ["| seed | base step | full: step, val, test | LoRA (lr by val): lr, step, val, test | LoRA - full, test points |",
           "| ---: | ---: | --- | --- | ---: |"]
  for x in r["seeds"]:
    f, lo = x["full"], x["lora"]
    lines.append(f"| {x['seed']} | {x['base_step']} | {f['step']}, {pct(f['val'])}, {pct(f['test'])} | "
                 f"{lo['lr']:g}, {lo['step']}, {pct(lo['val'])}, {pct(lo['test'])} | {x['gap_points']:+.1f} |")
  gaps = [x["gap_points"] for x in r["seeds"]]
  lines += ["", f"LoRA - full over seeds: mean {np.mean(gaps):+.1f} points"
            + (f", std {np.std(gaps, ddof=1):.1f}" if len(gaps) > 1 else "")]
  lines += ["", "Every run (best step by validation: val, test):"]
  for x in r["seeds"]:
    lines.append(f"- seed {x['seed']}: " + "; ".join(
        f"{name} {run['best']['step']}: {pct(run['best']['val'])}, {pct(run['best']['test'])}"
        for name, run in x["runs"].items()))
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "posttrain", "rl_must_win"))
  p.add_argument("--results", default=os.path.join(HERE, "lora_gap"))
  a = p.parse_args(argv)
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.join(a.out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  machine = (f"{datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}, "
             f"{jax.devices()[0].platform} x {jax.device_count()}, {os.cpu_count()} cores")
  chosen = {x["seed"]: x["base_step"] for x in
            json.load(open(os.path.join(HERE, "rm_chain", "results.json")))["seeds"]}
  os.makedirs(a.results, exist_ok=True)
  seeds = []
  for seed in (int(x) for x in a.seeds.split(",")):
    seeds.append(run_seed(os.path.join(a.out, f"seed{seed}"), WIN.BUDGET, seed, chosen[seed], a.rank))
    r = {"machine": machine, "command": f"python experiments/posttrain/lora_gap.py --seeds {a.seeds} --rank {a.rank}",
         "rank": a.rank, "seeds": seeds}
    with open(os.path.join(a.results, "results.json"), "w") as f:
      json.dump(r, f, indent=1)
    with open(os.path.join(a.results, "table.md"), "w") as f:
      f.write(f"{machine}\n\n`{r['command']}`\n\n{table(r)}")
    print(table(r), flush=True)
  return r


if __name__ == "__main__":
  main()
