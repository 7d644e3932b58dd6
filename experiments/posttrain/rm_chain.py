"""The reward-model chain (issue 25 item 3): a reward model trained on preference pairs, then PPO and
GRPO with its reward alone, with the gold reward (exact match) tracked beside the learned one.

Per seed: the chain's base and SFT (rl_must_win.best_sft, SFT on clean problems of every kind, its
step chosen on validation); a reward model (train.task=rm) from that SFT step on `rm_pairs` preference
pairs of exact.py (chosen right, rejected wrong the way people get them wrong: a carry dropped, a digit
off by one); then PPO and GRPO from the SFT step with posttrain.rewards="" and
posttrain.reward_model=the RM, run.py's chain budget (200 steps of 256 samples, temperature 0.7). Logged
every step: the learned reward (reward_mean, reward_std), the gold reward of the same samples (the
`accuracy` metric: exact match against the prompt's answer), KL to the reference; greedy exact match on
held-out prompts every 40 steps. Over-optimization shows as the learned reward rising while the gold one
falls. Compute per step: the step time (median over steps 2..N-1, rollout included) and
the steps to converge (run.curve_stats of the learned reward), PPO against GRPO.

  python experiments/posttrain/rm_chain.py [--seeds 0,1,2] [--out DIR] [--quick]
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain.posttrain import exact  # noqa: E402


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"posttrain_{name}", os.path.join(HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


WIN = _load("rl_must_win")
RUN = WIN.RUN
BUDGET = dict(WIN.BUDGET, rm_pairs=2000, rm_steps=200, rm_batch=16, rm_lr=1e-3)
QUICK = dict(WIN.QUICK, rm_pairs=64, rm_steps=2, rm_batch=8, rm_lr=1e-3)
METHODS = ("ppo", "grpo")


def rm_config(base_cfg, pairs_path: str, sft_dir: str, b: dict):
  """A reward model (scalar head, Bradley-Terry) from the SFT step on pairs_path, 10% held out."""
  c = base_cfg.copy_and_resolve_references()
  c.train.update(task="rm", steps=b["rm_steps"], batch_size=b["rm_batch"], log_every=max(1, b["rm_steps"] // 10),
                 eval_every=b["rm_steps"], eval_batches=4)
  c.posttrain.update(train_path=pairs_path, eval_path="", eval_fraction=0.1)
  c.optim.update(lr=b["rm_lr"], warmup_steps=max(1, b["rm_steps"] // 20), schedule="cosine")
  c.checkpoint.update(init_from=sft_dir, every_steps=b["rm_steps"], keep_every_steps=0)
  return c


def run_seed(out: str, b: dict, quick: bool, seed: int) -> dict:
  t_start = time.time()
  s = WIN.splits(b, seed, carry_in_sft=True)
  d = os.path.join(out, f"rm_chain_seed{seed}")
  scores = WIN.scorer(s, b["rl_new_tokens"])
  start = WIN.best_sft(out, d, b, quick, seed, s, scores)
  pairs = exact.make_sets(0, 0, b["rm_pairs"], 0, 0.0, seed, **b["digits"])["pairs"]
  pairs_path = RUN.write_jsonl(pairs, os.path.join(d, "pairs.jsonl"))
  rm_dir = os.path.join(d, "rm")
  t0 = time.time()
  jaxtrain.train(rm_config(start["base_cfg"], pairs_path, start["start_dir"], b), rm_dir, progress=False,
                 start_over=True)
  rm_rows = jaxtrain.read_metrics(rm_dir, as_frame=False)
  rm = {"train_s": round(time.time() - t0, 1), "pairs": len(pairs),
        **{k: round(float(v), 4) for r in rm_rows for k, v in r.items()
           if k in ("eval_accuracy", "eval_margin", "eval_loss")}}
  print(json.dumps({"rm": rm}), flush=True)
  rl_path = RUN.write_jsonl(s["rl"], os.path.join(d, "rl.jsonl"))
  methods = {}
  for task in METHODS:
    c = RUN.rl_config(start["base_cfg"], task, rl_path, start["start_dir"], b)
    c.posttrain.update(rewards="", reward_model=rm_dir, reward_model_weight=1.0)
    workdir = os.path.join(d, task)
    t0 = time.time()
    jaxtrain.train(c, workdir, progress=False, start_over=True)
    train_s = round(time.time() - t0, 1)
    rows = [r for r in jaxtrain.read_metrics(workdir, as_frame=False) if "reward_mean" in r]
    steps = [{"step": r["step"], "learned": round(float(r["reward_mean"]), 5),
              "learned_std": round(float(r["reward_std"]), 5), "gold": round(float(r["accuracy"]), 5),
              "kl": round(float(r["kl"]), 5), "step_time_s": round(float(r["step_time_s"]), 4)} for r in rows]
    greedy = [scores(workdir, k) for k in range(b["rl_every"], b["rl_steps"] + 1, b["rl_every"])]
    learned = [x["learned"] for x in steps]
    gold = [x["gold"] for x in steps]
    w = b["rl_window"]
    methods[task] = {
        "steps": steps, "greedy": greedy, "train_s": train_s,
        # a row's window holds the next step's rollout (metrics are read a step late): not the first
        # (compilation) nor the last (no next rollout)
        "step_time_s_median": round(float(np.median([x["step_time_s"] for x in steps[1:-1]] or [0.0])), 4),
        "learned_stats": RUN.curve_stats(learned, w), "gold_stats": RUN.curve_stats(gold, w),
        "gold_peak": {"step": int(steps[int(np.argmax(gold))]["step"]), "value": round(float(max(gold)), 4)},
        "kl_last": round(float(np.mean([x["kl"] for x in steps[-w:]])), 5),
        "learned_std_last": round(float(np.mean([x["learned_std"] for x in steps[-w:]])), 5)}
    print(json.dumps({task: {k: v for k, v in methods[task].items() if k != "steps"}}), flush=True)
  return {"seed": seed, "base_step": start["base_step"], "best_sft": start["best"], "rm": rm,
          "methods": methods, "wall_s": round(time.time() - t_start, 1)}


def table(r: dict) -> str:
  pct = lambda v: f"{100 * v:.1f}%"
  lines = ["| seed | best SFT (val, test) | RM held-out accuracy | method | learned reward, first -> last 10 "
           "steps | gold (sampled exact match), first -> last 10 | gold peak (step) | greedy test, last | "
           "KL, last 10 | reward std, last 10 | steps to converge (learned) | step time, median s |",
           "| ---: | --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
  for x in r["seeds"]:
    sft, rm = x["best_sft"], x["rm"]
    head = (f"| {x['seed']} | {pct(sft['val'])}, {pct(sft['test'])} | "
            f"{pct(rm['eval_accuracy']) if 'eval_accuracy' in rm else '-'} |")
    for task, m in x["methods"].items():
      ls, gs = m["learned_stats"], m["gold_stats"]
      lines.append(f"{head} {task.upper()} | {ls['first_mean']:.3f} -> {ls['last_mean']:.3f} | "
                   f"{gs['first_mean']:.3f} -> {gs['last_mean']:.3f} | {m['gold_peak']['value']:.3f} "
                   f"({m['gold_peak']['step']}) | {pct(m['greedy'][-1]['test'])} | {m['kl_last']:.4f} | "
                   f"{m['learned_std_last']:.3f} | {ls['steps_to_converge']} | {m['step_time_s_median']} |")
      head = "| | | |"
  times = {t: [x["methods"][t]["step_time_s_median"] for x in r["seeds"]] for t in METHODS}
  ratio = [g / p for g, p in zip(times["grpo"], times["ppo"]) if p]
  if ratio:
    lines += ["", f"GRPO step time / PPO step time, by seed: {', '.join(f'{v:.3f}' for v in ratio)} "
              f"(median {np.median(ratio):.3f})"]
  return "\n".join(lines) + "\n"


def plot(r: dict, path: str) -> None:
  """Learned and gold reward per RL step, PPO and GRPO, every seed; KL below."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(7, 5.5))
  FigureCanvasAgg(fig)
  top, bottom = fig.subplots(2, 1, sharex=True)
  colors = {"ppo": "tab:orange", "grpo": "tab:blue"}
  for x in r["seeds"]:
    for task, m in x["methods"].items():
      steps = [e["step"] for e in m["steps"]]
      first = x is r["seeds"][0]
      top.plot(steps, [e["learned"] for e in m["steps"]], color=colors[task], alpha=0.8,
               label=f"{task.upper()} learned (RM)" if first else None)
      top.plot(steps, [e["gold"] for e in m["steps"]], color=colors[task], ls=":", alpha=0.8,
               label=f"{task.upper()} gold (exact match)" if first else None)
      bottom.plot(steps, [e["kl"] for e in m["steps"]], color=colors[task], alpha=0.8,
                  label=f"{task.upper()} KL" if first else None)
  top.set(ylabel="reward of the step's samples", title="learned vs gold reward (every seed)")
  bottom.set(xlabel="RL step", ylabel="KL to the reference")
  for a in (top, bottom):
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "posttrain", "rl_must_win"),
                 help="data and workdirs (rl_must_win's by default: the same bases are reused)")
  p.add_argument("--quick", action="store_true", help="a tiny budget (the tests'); results go under --out")
  p.add_argument("--results", default="", help="where results go (default: beside this file; --quick: --out)")
  a = p.parse_args(argv)
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.join(a.out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  machine = (f"{datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}, "
             f"{jax.devices()[0].platform} x {jax.device_count()}, {os.cpu_count()} cores")
  b = QUICK if a.quick else BUDGET
  dest = a.results or (a.out if a.quick else os.path.join(HERE, "rm_chain"))
  os.makedirs(dest, exist_ok=True)
  seeds = []
  for seed in (int(x) for x in a.seeds.split(",")):
    seeds.append(run_seed(os.path.join(a.out, f"seed{seed}"), b, a.quick, seed))
    command = f"python experiments/posttrain/rm_chain.py --seeds {a.seeds}" + (" --quick" if a.quick else "")
    r = {"machine": machine, "command": command, "seeds": seeds}
    with open(os.path.join(dest, "results.json"), "w") as f:
      json.dump(r, f, indent=1)
    with open(os.path.join(dest, "table.md"), "w") as f:
      f.write(f"{machine}\n\n`{command}`\n\n{table(r)}")
    plot(r, os.path.join(dest, "rm_chain.png"))
    print(table(r), flush=True)
  return r


if __name__ == "__main__":
  main()
