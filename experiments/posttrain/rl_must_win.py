"""A task where RL has to win (issue 25 item 2): SFT demonstrations are absent for the harder half.

The chain's setting (run.py --study chain: a tiny byte model pre-trained on 2-digit additions with 20%
wrong answers), except that the clean SFT set holds only problems whose ones column does not carry
(about 55% of them). The held-out test prompts, the validation prompts and the RL prompts are drawn
from all problems; RL's reward is exact match. Every choice is made on the validation split alone:
the base (earliest kept step from which SFT reaches `chain_sft_target` on validation), SFT's
checkpoint (best on validation: "best SFT", RL's start), and each arm's reported checkpoint (best on
validation among its saved steps; the last step is reported beside it). Arms, from the best SFT:

  GRPO and PPO, 200 steps of 256 samples (run.py's chain budget);
  SFT continued for the same compute: 200 steps on the same SFT set, each step as many tokens as an
  RL step trains on (256 x 12 = 48 packed rows of 64; the rollouts' sampling not counted), cosine from
  SFT's lr.

  python experiments/posttrain/rl_must_win.py [--seeds 0,1,2] [--out DIR] [--quick]

writes results.json, table.md and rl_must_win.png into experiments/posttrain/rl_must_win/ (--quick:
the tests' tiny budget, under --out).
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


def _load_run():
  spec = importlib.util.spec_from_file_location("posttrain_run", os.path.join(HERE, "run.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


RUN = _load_run()  # the chain's budget, base, SFT and RL configs, greedy decoding

BUDGET = dict(RUN.CHAIN, n_val=200)
QUICK = dict(RUN.QUICK, digits=dict(min_digits=2, max_digits=2), n_val=8)
ARMS = ("sft_continued", "grpo", "ppo")


def ones_carry(prompt: str) -> bool:
  """True when the problem's ones column carries (the harder half, never demonstrated)."""
  a, b = exact.parse_prompt(prompt)
  return a % 10 + b % 10 >= 10


def splits(b: dict, seed: int, carry_in_sft: bool = False) -> dict:
  """The prompt sets, as lists of {prompt, answer}: test (held out by hash), rl (training side),
  val (training side, none in rl), sft ({prompt, completion}, training side, none in val or rl; no
  ones carry unless carry_in_sft): run.py's streams."""
  digits = b["digits"]
  test = exact.make_sets(0, 0, 0, b["n_eval"], 0.0, seed, **digits)["eval"]
  rl = [{"prompt": r["prompt"], "answer": r["completion"]}
        for r in exact.make_sets(0, b["n_rl"], 0, 0, 0.0, seed + 1, **digits)["sft"]]
  taken = {r["prompt"] for r in rl}
  val = [{"prompt": r["prompt"], "answer": r["completion"]}
         for r in exact.make_sets(0, 4 * b["n_val"], 0, 0, 0.0, seed + 2, **digits)["sft"]
         if r["prompt"] not in taken]
  val = list({r["prompt"]: r for r in val}.values())[:b["n_val"]]
  taken |= {r["prompt"] for r in val}
  pool = exact.make_sets(0, 8 * b["chain_sft"], 0, 0, 0.0, seed, **digits)["sft"]
  sft = [r for r in pool if (carry_in_sft or not ones_carry(r["prompt"])) and r["prompt"] not in taken]
  sft = sft[:b["chain_sft"]]
  return {"test": test, "val": val, "rl": rl, "sft": sft}


def scorer(s: dict, new_tokens: int):
  """(workdir, step) -> greedy exact match on validation and test, and on test's carry / no-carry
  halves."""
  def scores(workdir, step) -> dict:
    out = {}
    for name in ("val", "test"):
      rows = s[name]
      completions = RUN.greedy(workdir, step, [r["prompt"] for r in rows], new_tokens)
      right = np.array([exact.parse_completion(c) == r["answer"] for c, r in zip(completions, rows)])
      out[name] = round(float(right.mean()), 4)
      if name == "test":
        carry = np.array([ones_carry(r["prompt"]) for r in rows])
        out["test_carry"] = round(float(right[carry].mean()), 4)
        out["test_no_carry"] = round(float(right[~carry].mean()), 4)
    return {"step": step, **out}
  return scores


def best_sft(out: str, d: str, b: dict, quick: bool, seed: int, s: dict, scores) -> dict:
  """The base pre-trained with chain_noise wrong answers (run.py's), then SFT on s["sft"] from its kept
  steps, earliest first, until one SFT run reaches chain_sft_target on validation; that run's best step
  on validation (the earliest of ties) is kept in d/sft_best. What was searched and chosen."""
  base_cfg, base_dir, _ = RUN.train_base(out, {**b, "base_every": b["chain_base_every"]}, quick, seed,
                                         noise=b["chain_noise"])
  sft_path = RUN.write_jsonl([{"prompt": r["prompt"], "completion": r["completion"]} for r in s["sft"]],
                             os.path.join(d, "sft.jsonl"))
  eval_sft = RUN.write_jsonl([{"prompt": r["prompt"], "completion": r["answer"]} for r in s["val"]],
                             os.path.join(d, "val_sft.jsonl"))
  sft_b = {**b, "sft_lr": b["chain_sft_lr"]}
  every = b["chain_sft_every"]
  search = []
  for base_step in range(b["chain_base_from"], b["pretrain_steps"] + 1, b["chain_base_every"]):
    c = RUN.sft_config(base_cfg, sft_path, eval_sft,
                       RUN.keep_step(base_dir, base_step, os.path.join(d, "base_start")),
                       b["chain_sft_steps"], sft_b)
    c.checkpoint.update(every_steps=every, keep_every_steps=every)
    sft_dir = os.path.join(d, "sft")
    sft_s = RUN.sft(c, sft_dir)
    curve = [scores(sft_dir, k) for k in range(every, b["chain_sft_steps"] + 1, every)]
    search.append({"base_step": base_step, "sft_val": [x["val"] for x in curve], "sft_train_s": sft_s})
    print(json.dumps(search[-1]), flush=True)
    if max(x["val"] for x in curve) >= b["chain_sft_target"]:
      break
  best = max(curve, key=lambda x: (x["val"], -x["step"]))  # best on validation, the earliest of ties
  start_dir = RUN.keep_step(sft_dir, best["step"], os.path.join(d, "sft_best"))
  base = scores(base_dir, base_step)
  print(json.dumps({"base": base, "best_sft": best}), flush=True)
  return {"base_cfg": base_cfg, "base_step": base_step, "base": base, "search": search, "curve": curve,
          "best": best, "start_dir": start_dir, "sft_path": sft_path, "eval_sft": eval_sft, "sft_b": sft_b}


def run_seed(out: str, b: dict, quick: bool, seed: int) -> dict:
  t_start = time.time()
  s = splits(b, seed)
  d = os.path.join(out, f"rl_must_win_seed{seed}")
  scores = scorer(s, b["rl_new_tokens"])
  rl_path = RUN.write_jsonl(s["rl"], os.path.join(d, "rl.jsonl"))
  start = best_sft(out, d, b, quick, seed, s, scores)
  base_cfg, start_dir, best = start["base_cfg"], start["start_dir"], start["best"]
  sft_path, eval_sft, sft_b = start["sft_path"], start["eval_sft"], start["sft_b"]
  base_step, base, search, curve = start["base_step"], start["base"], start["search"], start["curve"]

  arms, rl_every = {}, b["rl_every"]
  for arm in ARMS:
    workdir = os.path.join(d, arm)
    if arm == "sft_continued":  # as many tokens a step as an RL step trains on, packed SFT rows
      rows = max(1, b["rl_batch"] * b["group"] * b["rl_seq_len"] // base_cfg.train.seq_len)
      c = RUN.sft_config(base_cfg, sft_path, eval_sft, start_dir, b["rl_steps"], {**sft_b, "sft_batch": rows})
      c.checkpoint.update(every_steps=rl_every, keep_every_steps=rl_every)
    else:
      c = RUN.rl_config(base_cfg, arm, rl_path, start_dir, b)
    t0 = time.time()
    jaxtrain.train(c, workdir, progress=False, start_over=True)
    train_s = round(time.time() - t0, 1)
    curve_arm = [scores(workdir, k) for k in range(rl_every, b["rl_steps"] + 1, rl_every)]
    chosen = max(curve_arm, key=lambda x: (x["val"], -x["step"]))
    arms[arm] = {"curve": curve_arm, "chosen": chosen, "last": curve_arm[-1], "train_s": train_s}
    print(json.dumps({"arm": arm, "chosen": chosen, "last": curve_arm[-1], "train_s": train_s}),
          flush=True)
  return {"seed": seed, "base_step": base_step, "base": base, "base_search": search,
          "sft_curve": curve, "best_sft": best, "arms": arms,
          "sizes": {k: len(v) for k, v in s.items()},
          "sft_carry_share": 0.0, "test_carry_share": round(float(np.mean(
              [ones_carry(r["prompt"]) for r in s["test"]])), 4),
          "wall_s": round(time.time() - t_start, 1)}


def summary(seeds: list[dict]) -> dict:
  """Per arm, test accuracy at its validation-chosen step minus the best SFT's, on every seed."""
  out = {}
  for arm in ARMS:
    gains = [r["arms"][arm]["chosen"]["test"] - r["best_sft"]["test"] for r in seeds]
    out[arm] = {"gain_points": [round(100 * g, 1) for g in gains],
                "mean_points": round(100 * float(np.mean(gains)), 1),
                "std_points": round(100 * float(np.std(gains, ddof=1)), 1) if len(gains) > 1 else None,
                "every_seed_at_least_10": bool(all(g >= 0.10 for g in gains))}
  return out


def table(r: dict) -> str:
  pct = lambda v: f"{100 * v:.1f}%"
  lines = ["| seed | base step (test) | best SFT: step, val, test (carry / no carry) | arm | chosen step, "
           "val, test (carry / no carry) | last step's test | test - best SFT | train s |",
           "| ---: | --- | --- | --- | --- | ---: | ---: | ---: |"]
  for x in r["seeds"]:
    sft = x["best_sft"]
    head = (f"| {x['seed']} | {x['base_step']} ({pct(x['base']['test'])}) | {sft['step']}, {pct(sft['val'])}, "
            f"{pct(sft['test'])} ({pct(sft['test_carry'])} / {pct(sft['test_no_carry'])}) |")
    for arm in ARMS:
      a = x["arms"][arm]
      c = a["chosen"]
      lines.append(f"{head} {arm} | {c['step']}, {pct(c['val'])}, {pct(c['test'])} ({pct(c['test_carry'])} / "
                   f"{pct(c['test_no_carry'])}) | {pct(a['last']['test'])} | "
                   f"{100 * (c['test'] - sft['test']):+.1f} | {a['train_s']} |")
      head = "| | | |"
  lines += ["", "| arm | test - best SFT, points, by seed | mean | std over seeds | >= +10 on every seed |",
            "| --- | --- | ---: | ---: | --- |"]
  for arm, v in r["summary"].items():
    std = "-" if v["std_points"] is None else f"{v['std_points']:.1f}"
    lines.append(f"| {arm} | {', '.join(f'{g:+.1f}' for g in v['gain_points'])} | {v['mean_points']:+.1f} | "
                 f"{std} | {'yes' if v['every_seed_at_least_10'] else 'no'} |")
  return "\n".join(lines) + "\n"


def plot(r: dict, path: str) -> None:
  """Test accuracy by step after the best SFT, per arm and seed (the best SFT's level dashed)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6.5, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  colors = {"sft_continued": "tab:gray", "grpo": "tab:blue", "ppo": "tab:orange"}
  for x in r["seeds"]:
    for arm in ARMS:
      curve = x["arms"][arm]["curve"]
      ax.plot([0] + [e["step"] for e in curve], [100 * x["best_sft"]["test"]] + [100 * e["test"] for e in curve],
              "o-", ms=3, color=colors[arm], alpha=0.8, label=arm if x is r["seeds"][0] else None)
    ax.axhline(100 * x["best_sft"]["test"], color="k", ls=":", lw=0.8)
  ax.set(xlabel="step after the best SFT checkpoint", ylabel="held-out greedy exact match (%)", ylim=(-2, 102),
         title="no demonstrations with a ones carry: RL vs SFT (dotted: best SFT, per seed)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "posttrain", "rl_must_win"), help="data and workdirs")
  p.add_argument("--quick", action="store_true", help="a tiny budget (the tests'); results go under --out")
  p.add_argument("--results", default="", help="where results go (default: beside this file; --quick: --out)")
  a = p.parse_args(argv)
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.join(a.out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  machine = (f"{datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}, "
             f"{jax.devices()[0].platform} x {jax.device_count()}, {os.cpu_count()} cores")
  b = QUICK if a.quick else BUDGET
  dest = a.results or (a.out if a.quick else os.path.join(HERE, "rl_must_win"))
  os.makedirs(dest, exist_ok=True)
  seeds = []
  for seed in (int(x) for x in a.seeds.split(",")):
    seeds.append(run_seed(os.path.join(a.out, f"seed{seed}"), b, a.quick, seed))
    command = f"python experiments/posttrain/rl_must_win.py --seeds {a.seeds}" + (" --quick" if a.quick else "")
    r = {"machine": machine, "command": command, "seeds": seeds, "summary": summary(seeds)}
    with open(os.path.join(dest, "results.json"), "w") as f:  # after every seed: a partial run keeps its seeds
      json.dump(r, f, indent=1)
    with open(os.path.join(dest, "table.md"), "w") as f:
      f.write(f"{machine}\n\n`{command}`\n\n{table(r)}")
    plot(r, os.path.join(dest, "rl_must_win.png"))
    print(table(r), flush=True)
  return r


if __name__ == "__main__":
  main()
