"""experiments/posttrain/run.py: the domain task's data and scores (fast), and the whole script at its
--quick budget (slow: the three studies, seven SFT runs on one base, the chain's pre-training, SFT, GRPO and PPO)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures import ROOT

SCRIPT = os.path.join(ROOT, "experiments", "posttrain", "run.py")


@pytest.fixture(scope="module")
def run():
  spec = importlib.util.spec_from_file_location("posttrain_run", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_domain_rows_follow_the_rule_and_hold_out_their_eval_texts(run):
  train, held = run.domain_rows(1000, 0, held_out=False), run.domain_rows(300, 0, held_out=True)
  keyword_label = {w: k for k, ws in run.LABELS.items() for w in ws}
  for r in train + held:
    words = r["prompt"][len("ticket: "):-len(" =")].split()
    assert len(words) == 4 and all(len(w) == 5 for w in words)
    keywords = [w for w in words if w in keyword_label]
    assert keywords == words[-1:] and r["label"] == keyword_label[words[-1]]
    assert r["completion"] == run.CODES[r["label"]]
    assert sum(w in run.FILLERS for w in words) == 3
  assert len({len(r["prompt"]) for r in train + held}) == 1  # one prompt length: one decode batch
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
  assert run.domain_rows(50, 0, False) == train[:50]  # a smaller training set is a prefix of a larger one
  assert run.domain_rows(50, 1, False) != train[:50]
  counts = np.array([sum(r["label"] == k for r in train) for k in run.LABELS])
  assert counts.min() > 200  # roughly balanced over the 4 labels


def test_parse_label(run):
  assert sorted(run.CODES.values()) == ["1", "2", "3", "4"]
  for label, code in run.CODES.items():
    assert run.parse_label(code) == label and run.parse_label(code + "\nxyz") == label
  assert run.parse_label("12") is None  # a longer number is not a code
  assert run.parse_label(" 1") is None and run.parse_label("billing") is None and run.parse_label("") is None


def test_macro_f1_against_a_confusion_matrix(run):
  rng = np.random.default_rng(0)
  labels = sorted(run.LABELS)
  true = [labels[i] for i in rng.integers(4, size=200)]
  predicted = [None if rng.random() < 0.2 else labels[int(rng.integers(4))] if rng.random() < 0.5 else t for t in true]
  # reference: a 4 x 5 confusion matrix (last column: unparseable), precision and recall per class
  m = np.zeros((4, 5))
  for t, p in zip(true, predicted):
    m[labels.index(t), 4 if p is None else labels.index(p)] += 1
  precision = np.diag(m) / m[:, :4].sum(axis=0)
  recall = np.diag(m) / m.sum(axis=1)
  want = np.mean(2 * precision * recall / (precision + recall))
  assert run.macro_f1(true, predicted, labels) == pytest.approx(want, rel=1e-12)
  assert run.macro_f1(true, true, labels) == 1.0
  assert run.macro_f1(true, [None] * len(true), labels) == 0.0
  scores = run.domain_scores([run.CODES["billing"], "nope", run.CODES["account"]], ["billing", "billing", "network"])
  assert scores["accuracy"] == round(1 / 3, 4) and scores["unparseable"] == round(1 / 3, 4)


@pytest.mark.slow
@pytest.mark.long  # 162 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_quick_run_writes_both_studies(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device, as from the command line
  subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path)], check=True, env=env, cwd=ROOT,
                 capture_output=True, timeout=600)
  noise = json.load(open(tmp_path / "noise" / "results.json"))
  assert [r["sft_noise"] for r in noise["rows"]] == [0.0, 0.1, 0.2, 0.4]
  wrong = [r["wrong_in_sft_set"] for r in noise["rows"]]
  assert wrong[0] == 0.0 and wrong == sorted(wrong) and wrong[-1] > 0  # nested wrong rows
  domain = json.load(open(tmp_path / "domain" / "results.json"))
  assert [r["examples"] for r in domain["rows"]] == [50, 200, 1000]
  assert [r["keywords_seen"] for r in domain["rows"]][1:] == [32, 32]  # 200 examples show every keyword
  for study, r in (("noise", noise), ("domain", domain)):
    assert r["command"] == f"python experiments/posttrain/run.py --study {study} --quick"
    assert (tmp_path / study / f"{study}.png").stat().st_size > 1000
    table = (tmp_path / study / "table.md").read_text()
    assert table.count("\n| ") == len(r["rows"]) + 3  # header, rule, base, one line per arm
  chain = json.load(open(tmp_path / "chain" / "results.json"))  # the chain at the tiny budget: the pipeline runs
  assert [s["stage"].split()[0] for s in chain["stages"]] == ["pre-train", "SFT", "GRPO", "PPO"]
  assert all(len(chain["rl"][t]["steps"]) == 2 and "kl" in chain["rl"][t]["steps"][0] for t in ("grpo", "ppo"))
  assert (tmp_path / "chain" / "rl.png").stat().st_size > 1000
  # every SFT run started from the base: its saved config points there, and the base trained once
  for arm in ("noise/sft_0.4", "domain/sft_50"):
    cfg = json.load(open(tmp_path / arm / "config.json"))
    assert cfg["checkpoint"]["init_from"] == str(tmp_path / "base") and cfg["train"]["task"] == "sft"


def test_curve_stats_against_a_loop(run):
  rng = np.random.default_rng(0)
  values = np.clip(np.linspace(0.1, 0.7, 60) + rng.normal(0, 0.05, 60), 0, 1)
  w = 8
  s = run.curve_stats(values, w)
  first, last = values[:w].mean(), values[-w:].mean()
  target = first + 0.9 * (last - first)
  want = next(i + 1 for i in range(w - 1, len(values)) if sum(values[i - w + 1:i + 1]) / w >= target)
  assert s["steps_to_converge"] == want  # the step that completes the first window reaching 90% of the rise
  assert s["first_mean"] == round(first, 4) and s["last_mean"] == round(last, 4)
  assert s["last_std"] == round(float(np.std(values[-w:])), 4)
  assert s["last_step_change_std"] == round(float(np.std(np.diff(values[-w:]))), 4)
  assert run.curve_stats(values[::-1], w)["steps_to_converge"] is None  # a falling curve never converges up
  assert run.curve_stats(np.full(10, 0.5), 3)["steps_to_converge"] is None


def test_chain_rl_configs_validate_and_see_the_same_samples(run, tmp_path):
  from jaxtrain import config as config_lib
  for budget in (run.CHAIN, run.QUICK):
    base = run.base_config(str(tmp_path / "pretrain.jsonl"), budget, budget is run.QUICK, 0)
    cfgs = {task: run.rl_config(base, task, str(tmp_path / "rl.jsonl"), str(tmp_path / "sft"), budget)
            for task in ("grpo", "ppo")}
    for task, c in cfgs.items():
      config_lib.validate(c, 1)
      assert c.train.task == task and c.checkpoint.init_from == str(tmp_path / "sft")
      assert c.posttrain.rewards == "exact_match:1.0" and c.train.eval_every == 0
      # the longest prompt (BOS + "999+999=") and answer (4 digits + EOS) fit the rollout's slots
      digits = budget.get("digits", {}).get("max_digits", 3)
      assert c.train.seq_len - c.posttrain.max_new_tokens >= 1 + 2 * digits + 2
      assert c.posttrain.max_new_tokens >= digits + 2
    g, p = cfgs["grpo"], cfgs["ppo"]
    assert g.train.batch_size * g.posttrain.group_size == p.train.batch_size * p.posttrain.group_size
    assert p.posttrain.group_size == 1 and g.posttrain.group_size >= 2
    assert g.posttrain.temperature == p.posttrain.temperature == budget["rl_temperature"]  # both sample alike
