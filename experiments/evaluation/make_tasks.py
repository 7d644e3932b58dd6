"""Builds the study's task files from this Python's own standard library (no downloads), deterministically.

  python experiments/evaluation/make_tasks.py [--docs 1500] [--out experiments/evaluation/tasks]

The model trains on the stdlib's top-level *.py (config.py's data.path, a glob that does not descend into
packages); the tasks come from two packages that glob never matches:

  next_line.jsonl   multiple_choice over email/**/*.py: a context of up to 6 whole lines, and 4 choices, the
                    true next line and 3 other lines of the same file with the same indentation (so that
                    neither indentation nor the file's vocabulary gives the answer away). Chance: 25%.
  next_indent.jsonl the same positions and contexts; the 4 choices are the true next line at its own
                    indentation and at the 3 nearest other multiples of 4 spaces: the same text, so the
                    choices' own likelihoods nearly cancel and only the context tells. Chance: 25%.
  *_control.jsonl   each doc of the two above with another doc's context (a fixed derangement): the
                    accuracy that the choices alone give.
  json_bpb.jsonl    perplexity (bits per byte) over json/*.py, one doc per top-level block.

BOS + context + the longest choice fit in 128 bytes (= tokens of the byte tokenizer = train.seq_len), so
the scorer never cuts a context and never scores a position the model did not train on. A doc whose
context + true line occurs verbatim in the training corpus (license headers, boilerplate) is dropped; the
script checks that no task source file is matched by the training glob, and prints the counts.
"""

import argparse
import glob
import json
import os
import random
import sysconfig

STDLIB = sysconfig.get_paths()["stdlib"]
HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_GLOB = os.path.join(STDLIB, "*.py")  # config.py's data.path
MC_PACKAGE, BPB_PACKAGE = "email", "json"
BUDGET = 128  # train.seq_len = model.max_seq_len: BOS + context + choice must fit
MAX_CONTEXT_LINES, MIN_LINE, MAX_LINE = 6, 8, 50  # a choice is 8-50 bytes stripped of trailing space
CHOICES = 4


def package_files(package: str) -> list[str]:
  return sorted(glob.glob(os.path.join(STDLIB, package, "**", "*.py"), recursive=True))


def nbytes(s: str) -> int:
  return len(s.encode("utf-8"))


def indent(line: str) -> str:
  return line[:len(line) - len(line.lstrip())]


def candidate(line: str) -> bool:
  """A line that can be a choice: 8-50 bytes, not blank."""
  return line.strip() != "" and MIN_LINE <= nbytes(line) <= MAX_LINE


def draw(rng: random.Random, pool: list[str]) -> list[str]:
  """CHOICES - 1 different lines drawn from `pool` with its repeats' weights."""
  out = []
  while len(out) < CHOICES - 1:
    x = rng.choice(pool)
    if x not in out:
      out.append(x)
  return out


def control(docs: list[dict], seed: int = 1) -> list[dict]:
  """The same docs, each with the context of another doc (a random derangement): what the choices alone
  give, without the context's information."""
  rng = random.Random(seed)
  order = list(range(len(docs)))
  while any(i == j for i, j in enumerate(order)):
    rng.shuffle(order)
  return [{**d, "context": docs[j]["context"], "source": d["source"] + " (context of " + docs[j]["source"] + ")"}
          for d, j in zip(docs, order)]


def indent_choices(rng: random.Random, target: str) -> list[str] | None:
  """The target's text at its own indentation and at the 3 nearest other multiples of 4 spaces (ties
  drawn at random), or None for a line not indented by a multiple of 4 spaces (a continuation line)."""
  n, text = len(indent(target)), target.lstrip()
  if "\t" in indent(target) or n % 4:
    return None
  levels = [k for k in range(0, n + 16, 4) if k != n]
  rng.shuffle(levels)
  levels = sorted(levels, key=lambda k: abs(k - n))[:CHOICES - 1]
  return [" " * k + text for k in levels]


def next_line_docs(train_text: str, n_docs: int, seed: int = 0):
  """(next_line docs, next_indent docs, dropped counts): the same positions and contexts."""
  rng = random.Random(seed)
  positions, lines_of = [], {}
  for path in package_files(MC_PACKAGE):
    lines = [line.rstrip() for line in open(path, encoding="utf-8").read().splitlines()]
    lines_of[path] = lines
    positions += [(path, i) for i in range(1, len(lines)) if candidate(lines[i]) and lines[i - 1].strip()]
  rng.shuffle(positions)
  same, indents, dropped = [], [], {"in_training_text": 0, "no_distractors": 0, "too_long": 0}
  for path, i in positions:
    if len(same) == n_docs:
      break
    lines = lines_of[path]
    target = lines[i]
    # every line of the file that could be a target, repeats kept: distractors are drawn as often as
    # the targets are (a line such as "else:" is a frequent target, so it is a frequent distractor)
    pool = [x for x in lines if candidate(x) and x.strip() != target.strip() and indent(x) == indent(target)]
    d_indent = indent_choices(rng, target)
    if len(set(pool)) < CHOICES - 1 or d_indent is None:
      dropped["no_distractors"] += 1
      continue
    d_same = draw(rng, pool)
    longest = max(nbytes(x) for x in [target, *d_same, *d_indent])
    context_lines = []
    for j in range(i - 1, max(-1, i - 1 - MAX_CONTEXT_LINES), -1):  # whole lines back from the target
      if 1 + nbytes("\n".join([lines[j], *context_lines]) + "\n") + longest > BUDGET:
        break
      context_lines.insert(0, lines[j])
    if not context_lines or not "".join(context_lines).strip() or "\t" in "".join(context_lines):
      dropped["too_long"] += 1
      continue
    context = "\n".join(context_lines) + "\n"
    if context + target in train_text:
      dropped["in_training_text"] += 1
      continue
    source = os.path.relpath(path, STDLIB)
    for docs, distractors in ((same, d_same), (indents, d_indent)):
      gold = rng.randrange(CHOICES)
      choices = list(distractors)
      choices.insert(gold, target)
      docs.append({"context": context, "choices": choices, "gold": gold, "source": f"{source}:{i + 1}"})
  return same, indents, dropped


def bpb_docs() -> list[dict]:
  """json/*.py cut at top-level blocks (a line starting without indentation after a blank line)."""
  docs = []
  for path in package_files(BPB_PACKAGE):
    block = []
    for line in open(path, encoding="utf-8").read().splitlines(keepends=True):
      if block and line[:1].strip() and not block[-1].strip():
        docs.append("".join(block))
        block = []
      block.append(line)
    if block:
      docs.append("".join(block))
  return [{"text": d} for d in docs if d.strip()]


def write(path: str, header: dict, docs: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps({"task": header}) + "\n")
    for d in docs:
      f.write(json.dumps(d, ensure_ascii=False) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--docs", type=int, default=1500, help="docs of each next_line task")
  parser.add_argument("--out", default=os.path.join(HERE, "tasks"))
  args = parser.parse_args()
  train_files = sorted(glob.glob(TRAIN_GLOB))
  task_files = package_files(MC_PACKAGE) + package_files(BPB_PACKAGE)
  overlap = set(train_files) & set(task_files)
  assert not overlap, f"task sources in the training glob: {sorted(overlap)}"
  train_text = "\n".join(open(p, encoding="utf-8", errors="replace").read() for p in train_files)
  same, indents, dropped = next_line_docs(train_text, args.docs)
  bpb = bpb_docs()
  os.makedirs(args.out, exist_ok=True)
  header = {"kind": "multiple_choice", "target_delimiter": ""}
  write(os.path.join(args.out, "next_line.jsonl"), header, same)
  write(os.path.join(args.out, "next_indent.jsonl"), header, indents)
  write(os.path.join(args.out, "json_bpb.jsonl"), {"kind": "perplexity"}, bpb)
  write(os.path.join(args.out, "next_line_control.jsonl"), header, control(same))
  write(os.path.join(args.out, "next_indent_control.jsonl"), header, control(indents))
  longest = max(1 + nbytes(d["context"]) + max(nbytes(c) for c in d["choices"]) for d in same + indents)
  print(f"stdlib {STDLIB}: training glob {len(train_files)} files; {MC_PACKAGE}/ {len(package_files(MC_PACKAGE))} "
        f"files, {BPB_PACKAGE}/ {len(package_files(BPB_PACKAGE))} files, none in the glob")
  print(f"next_line, next_indent: {len(same)} docs each (dropped {dropped}); longest request "
        f"{longest} bytes with BOS (budget {BUDGET}); mean context "
        f"{sum(d['context'].count(chr(10)) for d in same) / len(same):.2f} lines")
  print(f"json_bpb: {len(bpb)} docs, {sum(nbytes(d['text']) for d in bpb):,} bytes; wrote {args.out}")


if __name__ == "__main__":
  main()
