"""Two SFT studies (issue 13 item 8 b, c) on one base model pre-trained on the addition language, and the whole
post-training chain (items 6 and 8 a):

  noise:  held-out greedy exact-match accuracy after SFT on the same addition problems with 0, 10, 20, 40%
          of the answers wrong (exact.make_sets' sft_noise: the wrong rows at a share are among those
          wrong at a larger one);
  domain: accuracy and macro-F1 of a synthetic ticket-classification task (the label's one-digit code is the completion)
          after SFT on 50, 200 and 1,000 labeled examples, from a base that never saw the domain.

  chain:  pre-training on 2-digit additions with 20% wrong answers -> SFT on a small clean set -> GRPO and PPO
          (exact-match reward) from the same SFT step: greedy accuracy after each stage, reward mean/std and
          KL per RL step, the reward's fluctuation and steps to converge (budget CHAIN).

  python experiments/posttrain/run.py [--study noise|domain|chain|all] [--out DIR] [--results DIR] [--quick]

The base (config.py's model, 800 steps on 100,000 clean problems, seed 0) is trained once under
--out/base and reused by both studies while its last checkpoint is there. Every SFT run is
`jaxtrain.train` with train.task=sft, posttrain.train_path/eval_path and checkpoint.init_from=the base.
Writes results.json, table.md and a plot per study into experiments/posttrain/<study>/ (the full run) or
into --out/<study>/ (--quick: a 1-layer d_model 32 model, a few steps, a few prompts; what the tests run).
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the repository's jaxtrain, not an installed copy
  sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain.posttrain import exact  # noqa: E402

NOISE_SHARES = (0.0, 0.1, 0.2, 0.4)
DOMAIN_SIZES = (50, 200, 1000)


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"posttrain_{name}", os.path.join(HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


PRETRAIN = _load("pretrain_exact")  # tiny_config (config.py's) and completer (greedy decoding of a saved step)


# ---- budgets ----

FULL = dict(pretrain_steps=800, n_pretrain=100_000, n_eval=300, n_sft=2000, sft_steps=300, sft_batch=16,
            sft_lr=3e-3, domain_steps=300)
QUICK = dict(pretrain_steps=12, n_pretrain=2000, n_eval=16, n_sft=64, sft_steps=3, sft_batch=8,
             sft_lr=1e-3, domain_steps=3)
# chain (item 6, 8 a): the base above on 2-digit problems with chain_noise wrong answers (config.py's model,
# pretrain_steps, a checkpoint every chain_base_every from chain_base_from on), SFT on chain_sft clean problems
# (chain_sft_steps, a checkpoint every chain_sft_every) from each of those base checkpoints in turn until one
# SFT step answers chain_sft_target of n_select RL prompts: RL starts there. Then GRPO and PPO from that step
# on n_rl prompts: rl_batch prompts x group samples a step (PPO: rl_batch * group prompts, one each), sampled
# at rl_temperature. Where the model's jump comes in pre-training, and whether clean SFT triggers it, varies
# with the seed and the CPU (README): the search finds, for each, the earliest base that SFT makes partly right.
# The README's run and the slow test (tests/posttrain/test_chain.py) use this budget.
CHAIN = dict(FULL, pretrain_steps=600, n_pretrain=20_000, n_eval=200, digits=dict(min_digits=2, max_digits=2),
             chain_noise=0.2, chain_base_from=300, chain_base_every=50, chain_sft=200, chain_sft_steps=100,
             chain_sft_every=10, chain_sft_lr=3e-3, chain_sft_target=0.3, n_select=200, n_rl=1000, rl_steps=200,
             rl_every=40, rl_batch=32, group=8, rl_temperature=0.7, rl_seq_len=12, rl_new_tokens=5, grpo_lr=2e-4,
             grpo_kl=0.04, ppo_lr=3e-4, ppo_kl=0.05, rl_window=10)
QUICK.update(chain_noise=0.2, chain_base_from=6, chain_base_every=6, chain_sft=32, chain_sft_steps=2,
             chain_sft_every=1, chain_sft_lr=1e-3, n_rl=32, chain_sft_target=0.3, n_select=8, rl_steps=2, rl_every=1,
             rl_batch=2, group=4, rl_temperature=0.7, rl_seq_len=16, rl_new_tokens=6, grpo_lr=1e-4, grpo_kl=0.04,
             ppo_lr=1e-4, ppo_kl=0.05, rl_window=1)


def base_config(data_path: str, b: dict, quick: bool, seed: int):
  c = PRETRAIN.tiny_config(data_path, b["pretrain_steps"], b.get("base_every", b["pretrain_steps"]), seed)
  if "model" in b:
    c.model.update(**b["model"])
  if quick:
    c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
    c.train.update(batch_size=8, log_every=4)
  return c


def sft_config(base_cfg, train_path: str, eval_path: str, base_dir: str, steps: int, b: dict):
  """The base's model and tokenizer, SFT on train_path (completion tokens only), started from the base."""
  c = base_cfg.copy_and_resolve_references()
  c.train.update(task="sft", steps=steps, batch_size=b["sft_batch"], log_every=max(1, steps // 5), eval_every=0)
  c.posttrain.update(train_path=train_path, eval_path=eval_path)
  c.optim.update(lr=b["sft_lr"], warmup_steps=max(1, steps // 15), schedule="cosine")
  c.checkpoint.update(init_from=base_dir, every_steps=steps, keep_every_steps=0)
  return c


def train_base(out: str, b: dict, quick: bool, seed: int, noise: float = 0.0):
  """(config, workdir, data paths) of the base model pre-trained on a corpus with a share `noise` of wrong
  answers (0: --out/base, else --out/base_noise{noise}); trained unless its last step is already saved."""
  suffix = "" if noise == 0 else f"_noise{noise}"
  paths = exact.write_dataset(os.path.join(out, "data" + suffix), b["n_pretrain"], 0, 0, b["n_eval"], noise, seed,
                              **b.get("digits", {}))
  cfg, workdir = base_config(paths["pretrain"], b, quick, seed), os.path.join(out, "base" + suffix)
  done = os.path.join(workdir, "done.json")
  if not (os.path.isfile(done) and json.load(open(done)) == json.loads(cfg.to_json())):
    t0 = time.time()
    jaxtrain.train(cfg, workdir, progress=False, start_over=True)
    with open(done, "w") as f:
      f.write(cfg.to_json())
    print(json.dumps({"base_train_s": round(time.time() - t0, 1)}), flush=True)
  return cfg, workdir, paths


def sft(cfg, workdir: str) -> float:
  t0 = time.time()
  jaxtrain.train(cfg, workdir, progress=False, start_over=True)
  return round(time.time() - t0, 1)


def greedy(workdir: str, step: int, prompts, max_new_tokens: int):
  return PRETRAIN.completer(workdir, step, max_new_tokens=max_new_tokens)(prompts)


def write_jsonl(rows, path: str) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return path


# ---- (b) noisy SFT answers ----

def answer_stats(completions, prompts, answers) -> dict:
  """Exact-match accuracy, and the share of the problems with a carry answered with the carries dropped
  (the noise's most common wrong answer, exact.wrong_answer)."""
  right = [exact.parse_completion(c) == a for c, a in zip(completions, answers)]
  dropped = [exact.without_carries(*exact.parse_prompt(p))[::-1] for p in prompts]
  as_dropped = [exact.parse_completion(c) == d for c, d, a in zip(completions, dropped, answers) if d != a]
  return {"accuracy": round(float(np.mean(right)), 4), "carries_dropped_share": round(float(np.mean(as_dropped)), 4),
          "eval_with_carry": len(as_dropped)}


def study_noise(out: str, b: dict, quick: bool, seed: int) -> dict:
  base_cfg, base_dir, paths = train_base(out, b, quick, seed)
  evals = exact.read_jsonl(paths["eval"])
  prompts, answers = [r["prompt"] for r in evals], [r["answer"] for r in evals]
  eval_sft = write_jsonl([{"prompt": p, "completion": a} for p, a in zip(prompts, answers)],
                         os.path.join(out, "noise", "eval_sft.jsonl"))
  base = answer_stats(greedy(base_dir, b["pretrain_steps"], prompts, 6), prompts, answers)
  rows = []
  for share in NOISE_SHARES:
    sets = exact.make_sets(0, b["n_sft"], 0, 0, 0.0, seed, sft_noise=share)
    wrong = np.mean([exact.score(r["prompt"], r["completion"]) == 0.0 for r in sets["sft"]])
    train_path = write_jsonl(sets["sft"], os.path.join(out, "noise", f"sft_{share}.jsonl"))
    workdir = os.path.join(out, "noise", f"sft_{share}")
    train_s = sft(sft_config(base_cfg, train_path, eval_sft, base_dir, b["sft_steps"], b), workdir)
    completions = greedy(workdir, b["sft_steps"], prompts, 6)
    losses = [r["loss"] for r in jaxtrain.read_metrics(workdir, as_frame=False) if "loss" in r]
    rows.append({"sft_noise": share, "wrong_in_sft_set": round(float(wrong), 4),
                 **answer_stats(completions, prompts, answers),
                 "final_sft_loss": round(losses[-1], 4), "train_s": train_s})
    print(json.dumps(rows[-1]), flush=True)
  return {"base_accuracy": base["accuracy"], "base_carries_dropped_share": base["carries_dropped_share"],
          "eval_prompts": len(prompts), "sft_examples": b["n_sft"],
          "sft_steps": b["sft_steps"], "sft_batch_rows": b["sft_batch"], "sft_lr": b["sft_lr"], "rows": rows}


# ---- (c) domain adaptation from little data ----

LABELS = {  # a support-ticket domain: every word five letters, so every prompt has the same length
    "billing": ("price", "money", "bills", "taxes", "debit", "costs", "loans", "funds"),
    "network": ("wires", "modem", "cable", "ports", "relay", "proxy", "hosts", "pings"),
    "hardware": ("mouse", "disks", "chips", "board", "drive", "screw", "plugs", "laser"),
    "account": ("login", "email", "users", "roles", "token", "reset", "names", "badge"),
}
FILLERS = ("today", "again", "still", "after", "never", "often", "maybe", "quite", "about", "since", "while",
           "where", "which", "their", "other", "every")
CODES = {label: str(i + 1) for i, label in enumerate(sorted(LABELS))}  # the completion: a one-token code
DOMAIN_EVAL_SHARE = 0.2  # share of all texts (by hash) that only the eval set draws from


def domain_prompt(words) -> str:
  return "ticket: " + " ".join(words) + " ="


def domain_rows(n: int, seed: int, held_out: bool) -> list[dict]:
  """n labeled tickets {"prompt", "completion": CODES[label], "label"}: three fillers, then one keyword of a
  uniformly drawn category; the label is the keyword's category. Held-out texts (crc32 of the
  prompt below DOMAIN_EVAL_SHARE) never appear in a training set; a larger n extends a smaller one."""
  rng = np.random.default_rng([seed, 29, int(held_out)])
  labels, rows = sorted(LABELS), []
  while len(rows) < n:
    label = labels[int(rng.integers(len(labels)))]
    words = [FILLERS[int(i)] for i in rng.integers(len(FILLERS), size=3)]
    words.append(LABELS[label][int(rng.integers(len(LABELS[label])))])
    prompt = domain_prompt(words)
    if (zlib.crc32(prompt.encode()) / 2**32 < DOMAIN_EVAL_SHARE) == held_out:
      rows.append({"prompt": prompt, "completion": CODES[label], "label": label})
  return rows


def parse_label(completion: str):
  """The label a completion gives: its leading digits (exact.parse_completion), when they are a label's
  code; else None."""
  return {code: label for label, code in CODES.items()}.get(exact.parse_completion(completion))


def macro_f1(true, predicted, labels) -> float:
  """Mean over `labels` of per-class F1 (0 for a class with no true and no predicted example's overlap);
  a prediction of None (unparseable) is a miss of its true class and no class's false positive."""
  f1s = []
  for k in labels:
    tp = sum(t == k and p == k for t, p in zip(true, predicted))
    fp = sum(t != k and p == k for t, p in zip(true, predicted))
    fn = sum(t == k and p != k for t, p in zip(true, predicted))
    f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
  return float(np.mean(f1s))


def domain_scores(completions, true) -> dict:
  predicted = [parse_label(c) for c in completions]
  return {"accuracy": round(float(np.mean([p == t for p, t in zip(predicted, true)])), 4),
          "macro_f1": round(macro_f1(true, predicted, sorted(LABELS)), 4),
          "unparseable": round(float(np.mean([p is None for p in predicted])), 4)}


def study_domain(out: str, b: dict, quick: bool, seed: int) -> dict:
  base_cfg, base_dir, _ = train_base(out, b, quick, seed)
  evals = domain_rows(b["n_eval"], seed, held_out=True)
  prompts, true = [r["prompt"] for r in evals], [r["label"] for r in evals]
  eval_path = write_jsonl(evals, os.path.join(out, "domain", "eval.jsonl"))
  new_tokens = 2
  base = domain_scores(greedy(base_dir, b["pretrain_steps"], prompts, new_tokens), true)
  train_all = domain_rows(max(DOMAIN_SIZES), seed, held_out=False)
  rows = []
  for n in DOMAIN_SIZES:
    train_path = write_jsonl(train_all[:n], os.path.join(out, "domain", f"train_{n}.jsonl"))
    workdir = os.path.join(out, "domain", f"sft_{n}")
    train_s = sft(sft_config(base_cfg, train_path, eval_path, base_dir, b["domain_steps"], b), workdir)
    seen = {r["prompt"].split()[-2] for r in train_all[:n]}  # the keywords the training set shows
    completions = greedy(workdir, b["domain_steps"], prompts, new_tokens)
    known = np.array([p.split()[-2] in seen for p in prompts])
    right = np.array([parse_label(c) == t for c, t in zip(completions, true)])
    rows.append({"examples": n, **domain_scores(completions, true), "keywords_seen": len(seen),
                 "eval_with_seen_keyword": round(float(known.mean()), 4),
                 "accuracy_seen_keyword": round(float(right[known].mean()), 4) if known.any() else None,
                 "accuracy_unseen_keyword": round(float(right[~known].mean()), 4) if (~known).any() else None,
                 "train_s": train_s})
    print(json.dumps(rows[-1]), flush=True)
  return {"base": base, "eval_prompts": len(prompts), "keywords": sum(map(len, LABELS.values())),
          "sft_steps": b["domain_steps"], "sft_batch_rows": b["sft_batch"], "sft_lr": b["sft_lr"], "rows": rows}


# ---- (item 6 and 8 a) the whole chain: noisy pre-training -> SFT -> GRPO (and PPO from the same SFT) ----

def rl_config(base_cfg, task: str, prompts_path: str, sft_dir: str, b: dict):
  """GRPO or PPO from the SFT run (also the frozen reference) on prompts_path ({prompt, answer} rows),
  rewarded by exact_match; the same samples a step for both (PPO: rl_batch * group prompts, one sample
  each). Checkpoints every rl_every steps, all kept, for greedy evaluation."""
  c = base_cfg.copy_and_resolve_references()
  group = b["group"] if task == "grpo" else 1
  c.train.update(task=task, steps=b["rl_steps"], batch_size=b["rl_batch"] * b["group"] // group,
                 seq_len=b["rl_seq_len"], log_every=1, eval_every=0)
  c.posttrain.update(train_path=prompts_path, group_size=group, max_new_tokens=b["rl_new_tokens"],
                     temperature=b["rl_temperature"], top_k=0, top_p=1.0, clip_eps=0.2, kl_coef=b[f"{task}_kl"],
                     rewards="exact_match:1.0")
  c.optim.update(lr=b[f"{task}_lr"], warmup_steps=max(1, b["rl_steps"] // 20), schedule="constant",
                 weight_decay=0.0)
  c.checkpoint.update(init_from=sft_dir, every_steps=b["rl_every"], keep_every_steps=b["rl_every"])
  return c


def curve_stats(values, window: int) -> dict:
  """How a per-step curve (the RL reward mean) settles: its first and last `window` steps' means; the
  fluctuation, the std over the last window (and of its step-to-step changes); and the steps to converge,
  the first step at which the trailing `window`-step mean reaches 90% of the way from the first window's
  mean to the last's (None when it never moves up)."""
  v = np.asarray(values, np.float64)
  first, last = float(v[:window].mean()), float(v[-window:].mean())
  trailing = np.convolve(v, np.ones(window) / window, mode="valid")  # trailing[i]: steps i+1 .. i+window
  target = first + 0.9 * (last - first)
  reached = np.nonzero(trailing >= target)[0] if last > first else []
  return {"window": window, "first_mean": round(first, 4), "last_mean": round(last, 4),
          "last_std": round(float(v[-window:].std()), 4),
          "last_step_change_std": round(float(np.diff(v[-window:]).std()), 4) if window > 1 else None,
          "steps_to_converge": int(reached[0] + window) if len(reached) else None}


def keep_step(workdir: str, step: int, dest: str) -> str:
  """A checkpoint tier holding `step` of workdir alone, for `checkpoint.init_from` (which takes the newest)."""
  shutil.rmtree(dest, ignore_errors=True)
  shutil.copytree(os.path.join(workdir, "checkpoints", str(step)), os.path.join(dest, str(step)))
  return dest


def study_chain(out: str, b: dict, quick: bool, seed: int) -> dict:
  digits = b.get("digits", {})
  base_cfg, base_dir, paths = train_base(out, {**b, "base_every": b["chain_base_every"]}, quick, seed,
                                         noise=b["chain_noise"])
  evals = exact.read_jsonl(paths["eval"])
  prompts, answers = [r["prompt"] for r in evals], [r["answer"] for r in evals]
  new_tokens = b["rl_new_tokens"]
  d = os.path.join(out, "chain")
  # RL prompts: training-side problems (none held out) with their answers, another stream than the SFT set's.
  # The first n_select of them choose the base and RL's start: the held-out prompts choose nothing.
  rl_rows = exact.make_sets(0, b["n_rl"], 0, 0, 0.0, seed + 1, **digits)["sft"]
  rl_path = write_jsonl([{"prompt": r["prompt"], "answer": r["completion"]} for r in rl_rows],
                        os.path.join(d, "rl.jsonl"))
  select = rl_rows[:b["n_select"]]
  select_prompts, select_answers = [r["prompt"] for r in select], [r["completion"] for r in select]

  def accuracy(workdir, step, on=(prompts, answers)):
    """Greedy exact match of `step` of workdir on the held-out prompts, or on `on` = (prompts, answers)."""
    return round(exact.accuracy(lambda ps: greedy(workdir, step, ps, new_tokens), *on), 4)

  def select_accuracy(workdir, step):
    return accuracy(workdir, step, on=(select_prompts, select_answers))

  # SFT on a small clean set, from each kept base step in turn, until an SFT step reaches the target (else the
  # last base's last step): the earliest base that clean SFT makes partly right, as RL needs
  sets = exact.make_sets(0, b["chain_sft"], 0, 0, 0.0, seed, **digits)
  sft_path = write_jsonl(sets["sft"], os.path.join(d, "sft.jsonl"))
  eval_sft = write_jsonl([{"prompt": p, "completion": a} for p, a in zip(prompts, answers)],
                         os.path.join(d, "eval_sft.jsonl"))
  sft_b = {**b, "sft_lr": b["chain_sft_lr"]}
  sft_steps = range(b["chain_sft_every"], b["chain_sft_steps"] + 1, b["chain_sft_every"])
  search = []
  for base_step in range(b["chain_base_from"], b["pretrain_steps"] + 1, b["chain_base_every"]):
    c = sft_config(base_cfg, sft_path, eval_sft, keep_step(base_dir, base_step, os.path.join(d, "base_start")),
                   b["chain_sft_steps"], sft_b)
    c.checkpoint.update(every_steps=b["chain_sft_every"], keep_every_steps=b["chain_sft_every"])
    sft_dir = os.path.join(d, "sft")
    sft_s = sft(c, sft_dir)
    curve = [{"step": s, "rl_prompt_accuracy": select_accuracy(sft_dir, s)} for s in sft_steps]
    search.append({"base_step": base_step, "base_rl_prompt_accuracy": select_accuracy(base_dir, base_step),
                   "sft_rl_prompt_accuracy": [x["rl_prompt_accuracy"] for x in curve], "sft_train_s": sft_s})
    print(json.dumps(search[-1]), flush=True)
    reached = [i for i, x in enumerate(curve) if x["rl_prompt_accuracy"] >= b["chain_sft_target"]]
    if reached:
      break
  stages = [{"stage": "pre-train (noisy)", "steps": base_step, "accuracy": accuracy(base_dir, base_step)}]
  print(json.dumps(stages[-1]), flush=True)
  sft_curve = [{**x, "accuracy": accuracy(sft_dir, x["step"])} for x in curve]  # held out, the chosen SFT run's
  start = sft_curve[reached[0] if reached else -1]
  start_dir = keep_step(sft_dir, start["step"], os.path.join(d, "sft_start"))  # RL's init_from
  stages.append({"stage": "SFT (clean)", "steps": start["step"], "accuracy": start["accuracy"], "train_s": sft_s})
  print(json.dumps(stages[-1]), flush=True)
  keys = ("reward_mean", "reward_std", "kl", "entropy", "clip_fraction", "response_length", "accuracy")
  rl = {}
  for task in ("grpo", "ppo"):
    workdir = os.path.join(d, task)
    t0 = time.time()
    jaxtrain.train(rl_config(base_cfg, task, rl_path, start_dir, b), workdir, progress=False, start_over=True)
    train_s = round(time.time() - t0, 1)
    steps = [{"step": r["step"], **{k: round(float(r[k]), 5) for k in keys if k in r}}
             for r in jaxtrain.read_metrics(workdir, as_frame=False) if "reward_mean" in r]
    evals_rl = [{"step": s, "accuracy": accuracy(workdir, s)}
                for s in range(b["rl_every"], b["rl_steps"] + 1, b["rl_every"])]
    rl[task] = {"steps": steps, "greedy": evals_rl, "train_s": train_s,
                "reward_stats": curve_stats([r["reward_mean"] for r in steps], b["rl_window"]),
                "kl_last": round(float(np.mean([r["kl"] for r in steps[-b["rl_window"]:]])), 5)}
    stages.append({"stage": f"{task.upper()} (from SFT)", "steps": b["rl_steps"],
                   "accuracy": evals_rl[-1]["accuracy"], "train_s": train_s})
    print(json.dumps({**stages[-1], **rl[task]["reward_stats"]}), flush=True)
  return {"noise": b["chain_noise"], "eval_prompts": len(prompts),
          "digits": digits or {"min_digits": 2, "max_digits": 3}, "pretrain_steps_run": b["pretrain_steps"],
          "base_search": search, "sft_examples": b["chain_sft"], "sft_lr": b["chain_sft_lr"],
          "sft_batch_rows": b["sft_batch"], "sft_steps_run": b["chain_sft_steps"], "sft_target": b["chain_sft_target"],
          "select_prompts": len(select), "rl_prompts": b["n_rl"], "rl_prompts_a_step": b["rl_batch"],
          "group_size": b["group"], "rl_temperature": b["rl_temperature"],
          "grpo_lr": b["grpo_lr"], "ppo_lr": b["ppo_lr"], "grpo_kl_coef": b["grpo_kl"], "ppo_kl_coef": b["ppo_kl"],
          "stages": stages, "sft_curve": sft_curve, "rl": rl}


# ---- tables and plots ----

def chain_table(r: dict) -> str:
  lines = ["| stage | steps | held-out greedy exact match |", "| --- | ---: | ---: |"]
  lines += [f"| {x['stage']} | {x['steps']} | {x['accuracy']:.1%} |" for x in r["stages"]]
  lines += ["", "Base search (accuracy on the RL-side prompts that choose): " + "; ".join(
      f"step {x['base_step']}: base {x['base_rl_prompt_accuracy']:.1%}, SFT best {max(x['sft_rl_prompt_accuracy']):.1%}"
      for x in r["base_search"]), ""]
  lines += ["SFT (held out): " + ", ".join(f"step {x['step']} {x['accuracy']:.1%}" for x in r["sft_curve"]), ""]
  w = next(iter(r["rl"].values()))["reward_stats"]["window"]
  lines += [f"| RL from the SFT model | greedy, by step | reward, first {w} steps | reward, last {w} | "
            f"std of reward, last {w} | std of its step changes | steps to converge | KL, last {w} | train s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for task, x in r["rl"].items():
    st = x["reward_stats"]
    change = st["last_step_change_std"]  # None for a window of one step
    lines.append(f"| {task.upper()} | " + ", ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in x["greedy"]) +
                 f" | {st['first_mean']:.3f} | {st['last_mean']:.3f} | {st['last_std']:.3f} | "
                 f"{'-' if change is None else f'{change:.3f}'} | {st['steps_to_converge']} | {x['kl_last']:.4f} | "
                 f"{x['train_s']} |")
  return "\n".join(lines) + "\n"


def plot_chain(r: dict, dest: str) -> None:
  """chain.png: held-out greedy accuracy along the chain; rl.png: the RL reward (mean and std over a step's
  samples) and KL per step, GRPO and PPO."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6, 3.8))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  pre, sft_steps = r["stages"][0], r["stages"][1]["steps"]  # RL starts from SFT step sft_steps
  ax.plot([0], [100 * pre["accuracy"]], "ko", label=f"pre-trained, noise {r['noise']:.0%}")
  ax.plot([0] + [x["step"] for x in r["sft_curve"]],
          [100 * pre["accuracy"]] + [100 * x["accuracy"] for x in r["sft_curve"]], "o-", label="SFT (clean)")
  for task, x in r["rl"].items():
    ax.plot([sft_steps] + [sft_steps + e["step"] for e in x["greedy"]],
            [100 * r["stages"][1]["accuracy"]] + [100 * e["accuracy"] for e in x["greedy"]], "s-", label=task.upper())
  ax.axvline(sft_steps, color="gray", ls=":")
  ax.set(xlabel="post-training step (SFT, then RL)", ylabel="held-out greedy exact match (%)", ylim=(-2, 102),
         title=f"pre-train ({pre['steps']} steps) -> SFT -> RL")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(dest, "chain.png"), dpi=110)
  fig = Figure(figsize=(6.5, 5))
  FigureCanvasAgg(fig)
  top, bottom = fig.subplots(2, 1, sharex=True)
  for task, x in r["rl"].items():
    steps = np.array([e["step"] for e in x["steps"]])
    mean, std = np.array([e["reward_mean"] for e in x["steps"]]), np.array([e["reward_std"] for e in x["steps"]])
    line, = top.plot(steps, mean, label=f"{task.upper()} reward mean")
    top.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    bottom.plot(steps, [e["kl"] for e in x["steps"]], color=line.get_color(), label=f"{task.upper()} KL to reference")
  top.set(ylabel="exact-match reward", title="reward per RL step (band: std over the step's samples)")
  bottom.set(xlabel="RL step", ylabel="KL (k3)")
  for a in (top, bottom):
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(dest, "rl.png"), dpi=110)


def table(study: str, r: dict) -> str:
  if study == "chain":
    return chain_table(r)
  if study == "noise":
    lines = ["| wrong SFT answers | accuracy after SFT | answer = carries dropped | final SFT loss |",
             "| ---: | ---: | ---: | ---: |",
             f"| base (no SFT) | {r['base_accuracy']:.1%} | {r['base_carries_dropped_share']:.1%} | |"]
    lines += [f"| {x['wrong_in_sft_set']:.1%} | {x['accuracy']:.1%} | {x['carries_dropped_share']:.1%} | "
              f"{x['final_sft_loss']:.3f} |" for x in r["rows"]]
  else:
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    lines = ["| SFT examples | keywords seen | accuracy | macro-F1 | unparseable | accuracy, keyword seen | "
             "accuracy, keyword unseen |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| base (0) | 0/{r['keywords']} | {r['base']['accuracy']:.1%} | {r['base']['macro_f1']:.3f} | "
             f"{r['base']['unparseable']:.1%} | - | - |"]
    lines += [f"| {x['examples']} | {x['keywords_seen']}/{r['keywords']} | {x['accuracy']:.1%} | {x['macro_f1']:.3f} | "
              f"{x['unparseable']:.1%} | {pct(x['accuracy_seen_keyword'])} "
              f"({x['eval_with_seen_keyword']:.0%} of eval) | "
              f"{pct(x['accuracy_unseen_keyword'])} |" for x in r["rows"]]
  return "\n".join(lines) + "\n"


def plot(study: str, r: dict, path: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(5.5, 3.8))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  if study == "noise":
    x = [100 * row["sft_noise"] for row in r["rows"]]
    ax.plot(x, [100 * row["accuracy"] for row in r["rows"]], "o-", label="after SFT")
    ax.axhline(100 * r["base_accuracy"], color="gray", ls="--", label="base (no SFT)")
    ax.set(xlabel="wrong answers in the SFT set (%)", ylabel="held-out greedy accuracy (%)", xticks=x,
           title=f"SFT on {r['sft_examples']} addition problems, {r['sft_steps']} steps")
  else:
    x = [row["examples"] for row in r["rows"]]
    ax.plot(x, [100 * row["accuracy"] for row in r["rows"]], "o-", label="accuracy (%)")
    ax.plot(x, [100 * row["macro_f1"] for row in r["rows"]], "s-", label="macro-F1 (x100)")
    ax.axhline(100 * r["base"]["accuracy"], color="gray", ls="--", label="base accuracy")
    ax.axhline(25, color="gray", ls=":", label="chance (4 labels)")
    ax.set(xscale="log", xticks=x, xticklabels=[str(v) for v in x], xlabel="labeled SFT examples",
           ylabel="held-out score", title=f"ticket classification, SFT {r['sft_steps']} steps")
  ax.set_ylim(-2, 102)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


STUDIES = {"noise": study_noise, "domain": study_domain, "chain": study_chain}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--study", choices=("noise", "domain", "chain", "all"), default="all")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "posttrain", "studies"), help="data and workdirs")
  p.add_argument("--quick", action="store_true", help="a tiny budget (the tests'); results go under --out")
  p.add_argument("--results", default="", help="where results.json, table.md and plots go (default: beside this "
                 "file for a full run, under --out with --quick)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no_cache", action="store_true", help="no persistent compilation cache under --out")
  a = p.parse_args(argv)
  import jax
  if not a.no_cache:  # the SFT arms compile the same programs: compile each once
    jax.config.update("jax_compilation_cache_dir", os.path.join(a.out, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  machine = (f"{datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}, "
             f"{jax.devices()[0].platform} x {jax.device_count()}, {os.cpu_count()} cores")
  budgets = {"chain": QUICK if a.quick else CHAIN}
  results = {}
  for study in (STUDIES if a.study == "all" else (a.study,)):
    t0 = time.time()
    budget = budgets.get(study, QUICK if a.quick else FULL)
    r = STUDIES[study](a.out, budget, a.quick, a.seed)
    command = (f"python experiments/posttrain/run.py --study {study}" + (" --quick" if a.quick else "") +
               (f" --seed {a.seed}" if a.seed else ""))
    r = {"study": study, "machine": machine, "command": command, "wall_s": round(time.time() - t0, 1),
         "base_pretrain_steps": budget["pretrain_steps"], **r}
    dest = os.path.join(a.results or (a.out if a.quick else HERE), study)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "results.json"), "w") as f:
      json.dump(r, f, indent=1)
    with open(os.path.join(dest, "table.md"), "w") as f:
      f.write(f"{machine}\n\n`{command}`\n\n{table(study, r)}")
    if study == "chain":
      plot_chain(r, dest)
    else:
      plot(study, r, os.path.join(dest, f"{study}.png"))
    print(table(study, r), flush=True)
    results[study] = r
  return results


if __name__ == "__main__":
  main()
