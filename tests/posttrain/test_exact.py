"""The addition task: deterministic sets, the noise share, exact scoring, wrong answers, the files."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain.posttrain import exact


def _sum_of(text: str) -> tuple[int, int, str]:
  left, answer = text.split("=")
  a, b = left.split("+")
  return int(a), int(b), answer


def test_same_seed_same_sets_other_seed_other_sets():
  one = exact.make_sets(300, 50, 50, 50, noise=0.2, seed=3)
  assert one == exact.make_sets(300, 50, 50, 50, noise=0.2, seed=3)
  other = exact.make_sets(300, 50, 50, 50, noise=0.2, seed=4)
  assert all(one[k] != other[k] for k in one)
  # a set's size does not move the others: each draws from its own stream of the seed
  bigger = exact.make_sets(300, 80, 50, 50, noise=0.2, seed=3)
  assert bigger["pretrain"] == one["pretrain"] and bigger["eval"] == one["eval"]
  assert bigger["sft"][:50] == one["sft"]  # and a larger set extends a smaller one
  assert exact.make_sets(3000, 0, 0, 0, noise=0.2, seed=3)["pretrain"][:300] == one["pretrain"]


def test_noisier_sets_keep_the_problems_and_add_wrong_rows():
  rows = {share: exact.make_sets(0, 500, 0, 0, noise=0.0, seed=7, sft_noise=share)["sft"] for share in (0.1, 0.4)}
  assert [r["prompt"] for r in rows[0.1]] == [r["prompt"] for r in rows[0.4]]
  wrong = {share: {i for i, r in enumerate(rs) if exact.score(r["prompt"], r["completion"]) == 0.0}
           for share, rs in rows.items()}
  assert wrong[0.1] < wrong[0.4] and 20 < len(wrong[0.1]) < 80 and 160 < len(wrong[0.4]) < 240
  assert all(rows[0.1][i] == rows[0.4][i] for i in wrong[0.1])  # the same wrong answers


@pytest.mark.parametrize("noise", [0.0, 0.2, 1.0])
def test_noise_share_is_the_requested_one(noise):
  n = 4000
  rows = exact.make_sets(n, 0, 0, 0, noise=noise, seed=1)["pretrain"]
  wrong = [a + b != int(ans[::-1]) for a, b, ans in (_sum_of(r["text"]) for r in rows)]  # reversed answers
  share = float(np.mean(wrong))
  assert abs(share - noise) <= 4 * math.sqrt(noise * (1 - noise) / n) + 1e-12  # 4 sigma


def test_clean_sets_are_right_and_pairs_rejected_are_wrong():
  sets = exact.make_sets(0, 300, 300, 300, noise=0.5, seed=2)
  for r in sets["sft"]:
    assert exact.score(r["prompt"], r["completion"]) == 1.0
  for r in sets["eval"]:
    a, b = exact.parse_prompt(r["prompt"])
    assert r["answer"] == str(a + b)[::-1]
  for r in sets["pairs"]:
    assert exact.score(r["prompt"], r["chosen"]) == 1.0
    assert exact.score(r["prompt"], r["rejected"]) == 0.0
    assert r["rejected"].isdigit() and (len(r["rejected"]) == 1 or r["rejected"][-1] != "0")  # reversed


def test_wrong_answers_are_wrong_and_plausible():
  rng = np.random.default_rng(0)
  dropped = near = 0
  for _ in range(2000):
    a, b = int(rng.integers(10, 1000)), int(rng.integers(10, 1000))
    wrong = exact.wrong_answer(a, b, rng, reverse=False)
    right = str(a + b)
    assert wrong != right and wrong.isdigit()
    if wrong == exact._without_carries(a, b):
      dropped += 1
    else:  # one digit moved by one
      assert len(wrong) == len(right)
      diffs = [(int(x), int(y)) for x, y in zip(wrong, right) if x != y]
      assert len(diffs) == 1 and abs(diffs[0][0] - diffs[0][1]) == 1
      near += 1
  assert dropped > 400 and near > 400  # both kinds occur
  assert all(exact.wrong_answer(123, 45, rng)[::-1] != "168" for _ in range(20))


def test_score_is_exact():
  assert exact.score("123+45=", "861") == 1.0  # reversed by default
  assert exact.score("123+45=", "861\n12+3=51") == 1.0  # stops at the first non-digit
  assert exact.score("123+45=", "168") == 0.0
  for forward in ("168", "168\n12+3=15"):
    assert exact.score("123+45=", forward, reverse=False) == 1.0
  for wrong in ("8610", "86", " 861", ""):
    assert exact.score("123+45=", wrong) == 0.0
  assert exact.score("5+5=", "01") == 1.0 and exact.score("5+5=", "10", reverse=False) == 1.0
  with pytest.raises(ValueError, match="not an addition prompt"):
    exact.score("123-45=", "87")


def test_eval_problems_never_appear_in_training_sets():
  sets = exact.make_sets(3000, 300, 300, 300, noise=0.1, seed=5)
  train = {exact.parse_prompt(r["text"].split("=")[0] + "=") for r in sets["pretrain"]}
  train |= {exact.parse_prompt(r["prompt"]) for k in ("sft", "pairs") for r in sets[k]}
  held = {exact.parse_prompt(r["prompt"]) for r in sets["eval"]}
  assert not train & held
  assert all(exact.is_held_out(a, b) for a, b in held) and not any(exact.is_held_out(a, b) for a, b in train)
  digits = {len(str(x)) for a, b in train | held for x in (a, b)}
  assert digits == {2, 3}


def test_accuracy_takes_any_completer():
  rows = exact.make_sets(0, 0, 0, 40, noise=0.0, seed=0)["eval"]
  prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
  oracle = lambda ps: [exact.answer_of(*exact.parse_prompt(p)) + "\n" for p in ps]
  half = lambda ps: [str(sum(exact.parse_prompt(p)) + (i % 2))[::-1] for i, p in enumerate(ps)]
  assert exact.accuracy(oracle, prompts) == 1.0
  assert exact.accuracy(half, prompts, answers) == 0.5
  with pytest.raises(ValueError, match="completions for"):
    exact.accuracy(lambda ps: ps[:-1], prompts)


def test_write_dataset_and_cli_files(tmp_path):
  paths = exact.write_dataset(str(tmp_path / "a"), 20, 10, 10, 10, noise=0.3, seed=0, reverse=False)
  fields = {"pretrain": {"text"}, "sft": {"prompt", "completion"}, "pairs": {"prompt", "chosen", "rejected"},
            "eval": {"prompt", "answer"}}
  for name, path in paths.items():
    rows = exact.read_jsonl(path)
    assert len(rows) == (20 if name == "pretrain" else 10)
    assert all(set(r) == fields[name] and all(isinstance(v, str) for v in r.values()) for r in rows)
  out = subprocess.run([sys.executable, "-m", "jaxtrain.posttrain.exact", "--out", str(tmp_path / "b"),
                        "--n_pretrain", "20", "--n_sft", "10", "--n_pairs", "10", "--n_eval", "10",
                        "--noise", "0.3", "--forward"], capture_output=True, text=True, check=True)
  cli_paths = json.loads(out.stdout)
  for name in paths:
    with open(paths[name]) as f, open(cli_paths[name]) as g:
      assert f.read() == g.read()
  with pytest.raises(SystemExit, match=r"^error: exact: noise must be in \[0, 1\], got 1.5$"):
    exact.main(["--out", str(tmp_path / "c"), "--noise", "1.5"])
