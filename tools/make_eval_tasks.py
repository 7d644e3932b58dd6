"""Writes the small evaluation tasks shipped in jaxtrain/eval/tasks_data/, one of each kind, over
the synthetic copy language that configs/tiny.py trains (jaxtrain/data/synthetic.py: a document is
< x_1..x_n | x_1..x_n > with n distinct symbols, the copy determined by the half). Seeded: the same
files every run.

  python tools/make_eval_tasks.py [--out DIR]

  synthetic_copy_choice.jsonl    multiple_choice: the half's correct copy among three near misses
  synthetic_copy_choice.yaml     the same task as an lm-evaluation-harness task YAML over that file
  synthetic_heldout.jsonl        perplexity: documents drawn from the language, none from training
  synthetic_copy_generate.jsonl  generate: the copy of a half, greedy until EOS ('>')
  synthetic_sep_or_eos.jsonl     classification: a finished half (next '|') or a finished document
                                 (next '>')
  synthetic_code.jsonl           code: three Python functions over the language's text, with tests
  synthetic_dialogue.jsonl       dialogue: three chats that ask for a copy
The first five are in the symbols of configs/tiny.py's tokenizer (contexts without the '<' that the
scorer puts first as BOS); code and dialogue need a text tokenizer (a byte, BPE or HF model)."""

import argparse
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "jaxtrain", "eval", "tasks_data")
SYMBOLS, MAX_SYMBOLS, STOP_PROB = 200, 12, 0.001  # configs/tiny.py's data section
SEED, DOCS = 0, 32


def half(rng) -> list[int]:
  """A random half as synthetic.py draws it: geometric length capped at MAX_SYMBOLS, distinct."""
  n = min(int(rng.geometric(STOP_PROB)), MAX_SYMBOLS)
  return [int(s) for s in rng.permutation(SYMBOLS)[:n]]


def words(symbols) -> str:
  return " ".join(map(str, symbols))


def near_misses(rng, h: list[int]) -> list[list[int]]:
  """Three wrong copies: two neighbours swapped, one symbol replaced by an unused one, the half
  rotated by one."""
  i = int(rng.integers(len(h) - 1))
  swapped = h[:i] + [h[i + 1], h[i]] + h[i + 2:]
  j, unused = int(rng.integers(len(h))), [s for s in range(SYMBOLS) if s not in h]
  replaced = h[:j] + [int(rng.choice(unused))] + h[j + 1:]
  return [swapped, replaced, h[1:] + h[:1]]


def multiple_choice(rng) -> list[dict]:
  docs = []
  for _ in range(DOCS):
    h = half(rng)
    while len(h) < 2:  # a near miss needs two symbols
      h = half(rng)
    choices = [h, *near_misses(rng, h)]
    order = [int(k) for k in rng.permutation(len(choices))]
    docs.append({"context": f"{words(h)} |", "choices": [f"{words(choices[k])} >" for k in order],
                 "gold": order.index(0)})
  return docs


def perplexity(rng) -> list[dict]:
  return [{"text": f"{words(h)} | {words(h)} >"} for h in (half(rng) for _ in range(DOCS))]


def generate(rng) -> list[dict]:
  header = {"task": {"kind": "generate", "until": [">"], "max_new_tokens": MAX_SYMBOLS + 1}}
  return [header] + [{"context": f"{words(h)} |", "answer": words(h)}
                     for h in (half(rng) for _ in range(DOCS))]


def classification(rng) -> list[dict]:
  """Half the docs end with a half (SEP comes next), half with its copy (EOS comes next)."""
  docs = [{"task": {"kind": "classification", "labels": ["|", ">"]}}]
  for i in range(DOCS):
    h = half(rng)
    whole = i % 2 == 1
    docs.append({"context": f"{words(h)} | {words(h)}" if whole else words(h),
                 "label": ">" if whole else "|"})
  return docs


CODE = [
    ("def copy_document(half):\n"
     "    \"\"\"The document '< half | half >' of a list of symbols.\"\"\"\n",
     "def check(candidate):\n    assert candidate([3, 7]) == '< 3 7 | 3 7 >'\n"
     "    assert candidate([12]) == '< 12 | 12 >'\n", "copy_document"),
    ("def is_copy(text):\n"
     "    \"\"\"Whether the symbols after '|' in '< ... | ... >' repeat those before it."
     "\"\"\"\n",
     "def check(candidate):\n    assert candidate('< 3 7 | 3 7 >') is True\n"
     "    assert candidate('< 3 7 | 7 3 >') is False\n"
     "    assert candidate('< 5 | 5 6 >') is False\n",
     "is_copy"),
    ("def half_of(text):\n"
     "    \"\"\"The symbols (ints) between '<' and '|' of a document '< ... | ... >'."
     "\"\"\"\n",
     "def check(candidate):\n    assert candidate('< 3 7 | 3 7 >') == [3, 7]\n"
     "    assert candidate('< 41 | 41 >') == [41]\n", "half_of"),
]


def code(rng) -> list[dict]:
  del rng
  return [{"task": {"kind": "code", "max_new_tokens": 64}}] + [
      {"prompt": p, "tests": t, "entry_point": e} for p, t, e in CODE]


def dialogue(rng) -> list[dict]:
  docs = [{"task": {"kind": "dialogue", "max_new_tokens": 32}}]
  for i in range(3):
    h, g = half(rng)[:4], half(rng)[:3]
    first = [{"role": "user", "content": f"Copy: {words(h)}"}]
    if i == 2:  # a second turn after a solved first one
      first += [{"role": "assistant", "content": words(h)},
                {"role": "user", "content": f"Now copy: {words(g)}"}]
      h = g
    docs.append({"messages": first, "reference": words(h)})
  return docs


YAML = """\
# lm-evaluation-harness's task format over a local file: jaxtrain.evaluate reads it
# (jaxtrain/eval/task_yaml.py) as it reads synthetic_copy_choice.jsonl itself.
task: synthetic_copy_choice_yaml
dataset_path: json
dataset_kwargs:
  data_files:
    test: synthetic_copy_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

MAKERS = {"synthetic_copy_choice": multiple_choice, "synthetic_heldout": perplexity,
          "synthetic_copy_generate": generate, "synthetic_sep_or_eos": classification,
          "synthetic_code": code, "synthetic_dialogue": dialogue}


def write(out: str) -> list[str]:
  """Every task file under `out`; each kind draws from its own seeded generator."""
  os.makedirs(out, exist_ok=True)
  paths = []
  for i, (name, make) in enumerate(MAKERS.items()):
    records = make(np.random.default_rng([SEED, i]))
    paths.append(os.path.join(out, f"{name}.jsonl"))
    with open(paths[-1], "w", encoding="utf-8", newline="\n") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
  paths.append(os.path.join(out, "synthetic_copy_choice.yaml"))
  with open(paths[-1], "w", encoding="utf-8", newline="\n") as f:
    f.write(YAML)
  return paths


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=OUT,
                 help="the folder to write (default: jaxtrain/eval/tasks_data)")
  for path in write(p.parse_args(argv).out):
    print(path)


if __name__ == "__main__":
  main()
