"""A task with an exact answer: integer addition in text, "123+45=861" (the sum 168, reversed).
Numpy and stdlib only.

Byte-level on purpose: any byte-tokenizer model (data.kind "text" with data.tokenizer "byte", vocab
>= 258) reads it, and the existing samplers and decoders work unchanged. Operands have
min_digits..max_digits digits (no leading zeros), the number of digits of each drawn uniformly, then
the value. The answer is written least significant digit first ("123+45=861", `reverse`, the
default), the order in which carries are computed: a 2-layer d_model 128 model pre-trained for 800
steps answers 54% of held-out problems greedily this way, 3% with the usual order (reverse=False),
whose first digit needs every carry (experiments/posttrain/README.md).

One seed fixes every set: a pre-training corpus (a share `noise` of its answers wrong the way people
get them wrong: a carry dropped or one digit off by one), a clean SFT set, preference pairs (chosen
correct, rejected wrong in the same ways) and held-out eval prompts. Which problems are held out is
fixed by a hash of the problem (EVAL_SHARE of all), so no training set contains an eval problem.

  python -m jaxtrain.posttrain.exact --out DIR [--n_pretrain N ...] [--noise 0.2] [--seed 0]

writes DIR/pretrain.jsonl ({"text": "123+45=861"}, one problem a document: BOS text EOS through the
text pipeline, `--config.data.kind=text --config.data.path=DIR/pretrain.jsonl`), DIR/sft.jsonl
({"prompt": "123+45=", "completion": "861"}), DIR/pairs.jsonl ({"prompt", "chosen", "rejected"}) and
DIR/eval.jsonl ({"prompt", "answer"}). A model pre-trained on the corpus expects BOS + prompt, and
ends its answer with EOS: SFT and rollouts should frame prompt and completion the same way.
"""

import argparse
import json
import os
import zlib
from collections.abc import Callable, Sequence

import numpy as np

EVAL_SHARE = 0.1  # share of all problems (by hash) that only the eval set draws from
FILES = {"pretrain": "pretrain.jsonl", "sft": "sft.jsonl", "pairs": "pairs.jsonl",
         "eval": "eval.jsonl"}
_SETS = tuple(FILES)
_CHUNK = 1024  # problems drawn at a time


def is_held_out(a: int, b: int) -> bool:
  """True for the problems reserved for evaluation (crc32 of "a+b" below EVAL_SHARE)."""
  return zlib.crc32(f"{a}+{b}".encode()) / 2**32 < EVAL_SHARE


def prompt_of(a: int, b: int) -> str:
  return f"{a}+{b}="


def answer_of(a: int, b: int, reverse: bool = True) -> str:
  s = str(a + b)
  return s[::-1] if reverse else s


def parse_prompt(prompt: str) -> tuple[int, int]:
  """"123+45=" -> (123, 45); ValueError (one line) for anything else."""
  body = prompt[:-1] if prompt.endswith("=") else ""
  left, plus, right = body.partition("+")
  if not (plus and left.isdigit() and right.isdigit()):
    raise ValueError(f"exact: {prompt!r} is not an addition prompt 'A+B='")
  return int(left), int(right)


def parse_completion(completion: str) -> str:
  """The answer a completion gives: its leading run of digits (stops at the first other character,
  e.g. a newline, a '.', or the text after EOS); '' when it starts with anything else."""
  end = 0
  while end < len(completion) and completion[end] in "0123456789":
    end += 1
  return completion[:end]


def score(prompt: str, completion: str, reverse: bool = True) -> float:
  """1.0 when the completion's answer (parse_completion) is exactly the sum (reversed by default),
  else 0.0."""
  a, b = parse_prompt(prompt)
  return float(parse_completion(completion) == answer_of(a, b, reverse))


def wrong_answer(a: int, b: int, rng: np.random.Generator, reverse: bool = True) -> str:
  """A plausible wrong answer, never the right one: half the time (when the sum has a carry) the
  carries dropped (digit-wise sums mod 10), otherwise one digit moved by one (no leading zero)."""
  right = str(a + b)
  dropped = without_carries(a, b)
  if dropped != right and rng.random() < 0.5:
    wrong = dropped
  else:
    while True:
      i = int(rng.integers(len(right)))
      digit = int(right[i]) + int(rng.choice([-1, 1]))
      if 0 <= digit <= 9 and not (i == 0 and digit == 0 and len(right) > 1):
        wrong = right[:i] + str(digit) + right[i + 1:]
        break
  return wrong[::-1] if reverse else wrong


def without_carries(a: int, b: int) -> str:
  width = max(len(str(a)), len(str(b)))
  xs, ys = str(a).zfill(width), str(b).zfill(width)
  digits = "".join(str((int(x) + int(y)) % 10) for x, y in zip(xs, ys))
  return digits.lstrip("0") or "0"


def problems(n: int, rng: np.random.Generator, held_out: bool, min_digits: int = 2,
             max_digits: int = 3) -> list[tuple[int, int]]:
  """n operand pairs from the held-out share (held_out=True) or the rest, by rejection. Drawn in
  fixed chunks, so the first n of a longer draw are the n of a shorter one."""
  if not 1 <= min_digits <= max_digits:
    raise ValueError(f"exact: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
  out = []
  while len(out) < n:
    k = rng.integers(min_digits, max_digits + 1, size=(_CHUNK, 2))
    values = rng.integers(np.where(k == 1, 0, 10 ** (k - 1)), 10 ** k)
    out.extend((int(a), int(b)) for a, b in values if is_held_out(int(a), int(b)) == held_out)
  return out[:n]


def make_sets(n_pretrain: int, n_sft: int, n_pairs: int, n_eval: int, noise: float, seed: int,
              sft_noise: float = 0.0, min_digits: int = 2, max_digits: int = 3,
              reverse: bool = True) -> dict[str, list[dict]]:
  """The four sets as lists of JSON rows (see the module docstring). Each set has its own streams of
  the seed: changing one size leaves the other sets unchanged, and a larger set extends a smaller
  one."""
  for name, share in (("noise", noise), ("sft_noise", sft_noise)):
    if not 0 <= share <= 1:
      raise ValueError(f"exact: {name} must be in [0, 1], got {share}")
  # three streams per set (problems, which rows are wrong, their wrong answers): a set of n rows is
  # the first n rows of a larger one, and the rows wrong at a share are among those wrong at a
  # larger share
  rng = {(k, j): np.random.default_rng([seed, i, j]) for i, k in enumerate(_SETS) for j in range(3)}
  digits = dict(min_digits=min_digits, max_digits=max_digits)

  def labeled(name, n, share):
    for a, b in problems(n, rng[name, 0], False, **digits):
      wrong = rng[name, 1].random() < share
      # drawn for every row, used for the wrong ones
      bad = wrong_answer(a, b, rng[name, 2], reverse)
      yield prompt_of(a, b), bad if wrong else answer_of(a, b, reverse)

  return {
      "pretrain": [{"text": p + ans} for p, ans in labeled("pretrain", n_pretrain, noise)],
      "sft": [{"prompt": p, "completion": ans} for p, ans in labeled("sft", n_sft, sft_noise)],
      "pairs": [{"prompt": prompt_of(a, b), "chosen": answer_of(a, b, reverse),
                 "rejected": wrong_answer(a, b, rng["pairs", 2], reverse)}
                for a, b in problems(n_pairs, rng["pairs", 0], False, **digits)],
      "eval": [{"prompt": prompt_of(a, b), "answer": answer_of(a, b, reverse)}
               for a, b in problems(n_eval, rng["eval", 0], True, **digits)],
  }


def write_dataset(out_dir: str, n_pretrain: int, n_sft: int, n_pairs: int, n_eval: int,
                  noise: float, seed: int, **options) -> dict[str, str]:
  """Writes the four JSONL files (FILES) into out_dir; returns {set: path}. `options`:
  make_sets'."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  for name, rows in make_sets(n_pretrain, n_sft, n_pairs, n_eval, noise, seed, **options).items():
    paths[name] = os.path.join(out_dir, FILES[name])
    with open(paths[name], "w", encoding="utf-8") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
  return paths


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def accuracy(complete: Callable[[list[str]], Sequence[str]], prompts: Sequence[str],
             answers: Sequence[str] | None = None, reverse: bool = True) -> float:
  """Share of prompts whose completion (by `complete`, prompts -> completions, e.g. greedy decoding)
  is exactly right: against `answers` when given (eval.jsonl's), else against the sum (score)."""
  prompts = list(prompts)
  if not prompts:
    raise ValueError("exact.accuracy: no prompts")
  completions = list(complete(prompts))
  if len(completions) != len(prompts):
    raise ValueError(f"exact.accuracy: {len(completions)} completions for {len(prompts)} prompts")
  if answers is None:
    right = [score(p, c, reverse) for p, c in zip(prompts, completions)]
  else:
    right = [float(parse_completion(c) == a) for c, a in zip(completions, answers)]
  return float(np.mean(right))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m jaxtrain.posttrain.exact",
                              description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="directory for the four JSONL files")
  p.add_argument("--n_pretrain", type=int, default=100_000)
  p.add_argument("--n_sft", type=int, default=2_000)
  p.add_argument("--n_pairs", type=int, default=2_000)
  p.add_argument("--n_eval", type=int, default=500)
  p.add_argument("--noise", type=float, default=0.0,
                 help="share of wrong answers in the pre-training corpus")
  p.add_argument("--sft_noise", type=float, default=0.0,
                 help="share of wrong answers in the SFT set")
  p.add_argument("--min_digits", type=int, default=2)
  p.add_argument("--max_digits", type=int, default=3)
  p.add_argument("--forward", action="store_true",
                 help="write answers most significant digit first (the "
                      "usual order; default: reversed, least significant first)")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  try:
    paths = write_dataset(a.out, a.n_pretrain, a.n_sft, a.n_pairs, a.n_eval, a.noise, a.seed,
                          sft_noise=a.sft_noise, min_digits=a.min_digits, max_digits=a.max_digits,
                          reverse=not a.forward)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(json.dumps(paths))


if __name__ == "__main__":
  main()
