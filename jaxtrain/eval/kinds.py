"""The task kinds and their records (eval/tasks.py reads JSONL task files, eval/task_yaml.py
lm-evaluation-harness YAML): which kind a record is, the options each kind takes with their
defaults and checks, each kind's fields checked (check_doc), the Task they make, and JSON Lines
read by line. Errors are one ConfigError line naming the file and line."""

import dataclasses
import json
import os
import re

from jaxtrain import config as config_lib

KINDS = ("multiple_choice", "perplexity", "classification", "generate", "code", "dialogue")
HEADER_KEYS = ("kind", "target_delimiter", "fewshot_delimiter", "fewshot_file")
_str_list = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)
_int = lambda lo: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo
_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
# option: (default, check, what the check wants)
OPTIONS = {
    "until": (["\n\n"], _str_list, "a list of strings"),
    "max_new_tokens": (256, _int(1), "an integer >= 1"),
    "temperature": (0.0, _number, "a number >= 0"),
    "top_k": (0, _int(0), "an integer >= 0"),
    "answer_regex": (None, lambda v: isinstance(v, str), "a regular expression"),
    "n": (1, _int(1), "an integer >= 1"),
    "k": ([1], lambda v: isinstance(v, list) and v and all(map(_int(1), v)),
          "a non-empty list of integers >= 1"),
    "timeout_s": (5.0, lambda v: _number(v) and v > 0, "a number > 0"),
    "memory_mb": (512, _int(64), "an integer >= 64"),
    "labels": (None, lambda v: _str_list(v) and v and all(v) and len(set(v)) == len(v),
               "a non-empty list of distinct non-empty strings"),
    "reward_model": (None, lambda v: isinstance(v, str) and bool(v),
                     "a reward-model run's workdir (train.task=rm), relative to the task file"),
}
GENERATION = ("until", "max_new_tokens", "temperature", "top_k")
KIND_OPTIONS = {"multiple_choice": (), "perplexity": (), "classification": ("labels",),
                "generate": (*GENERATION, "answer_regex"),
                "code": (*GENERATION, "n", "k", "timeout_s", "memory_mb"),
                "dialogue": (*GENERATION, "reward_model")}
CODE_UNTIL = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # HumanEval's stop sequences


def error(path: str, line: int, what: str) -> config_lib.ConfigError:
  return config_lib.ConfigError(f"{path}:{line}: {' '.join(what.split())}")


FIELDS = {"classification": ("context", "label"), "generate": ("context", "answer"),
          "code": ("prompt", "tests")}
# the field that tells a record's kind when the file has no header kind
MARKS = {"choices": "multiple_choice", "text": "perplexity", "label": "classification",
         "answer": "generate", "tests": "code", "messages": "dialogue"}


def kind_of(path: str, n: int, doc) -> str:
  mark = next((f for f in MARKS if isinstance(doc, dict) and f in doc), None)
  if mark is None:
    raise error(path, n, f"cannot tell the task kind (a record with one of {tuple(MARKS)}, or "
                         f"a header {{\"task\": {{\"kind\": ...}}}} with kind one of {KINDS})")
  return MARKS[mark]


def options(path: str, n: int, header: dict, kind: str, fewshot: bool) -> dict:
  """The kind's options: the header's, checked, over the defaults."""
  for key, value in header.items():
    if key in HEADER_KEYS:
      if not isinstance(value, str):
        raise error(path, n, f"the header's {key!r} must be a string")
    elif key not in KIND_OPTIONS[kind]:
      raise error(path, n, f"the header's {key!r} is not an option of a {kind} task "
                           f"(options: {HEADER_KEYS + KIND_OPTIONS[kind]})")
    elif not OPTIONS[key][1](value):
      raise error(path, n, f"the header's {key!r} must be {OPTIONS[key][2]}, got {value!r}")
  opts = {key: header.get(key, OPTIONS[key][0]) for key in KIND_OPTIONS[kind]}
  if kind in ("code", "dialogue") and "until" not in header:
    opts["until"] = CODE_UNTIL if kind == "code" else []
  if kind == "classification" and opts["labels"] is None and not fewshot:
    raise error(path, n, "classification: the header needs 'labels', the list of labels")
  if kind == "code" and max(opts["k"]) > opts["n"]:
    raise error(path, n, f"code: every k must be <= n={opts['n']}, got k={opts['k']}")
  if opts.get("answer_regex") is not None:
    try:
      re.compile(opts["answer_regex"])
    except re.error as e:
      raise error(path, n, f"answer_regex does not compile: {e}") from None
  return opts


def _check_other(path: str, n: int, doc: dict, kind: str) -> dict:
  """The doc of a classification, generate, code or dialogue task, its fields checked."""
  if kind in FIELDS:
    for field in FIELDS[kind]:
      if not isinstance(doc.get(field), str) or (field in ("prompt", "tests") and not doc[field]):
        raise error(path, n, f"{kind}: needs a string field {field!r}")
    if kind == "code" and not isinstance(doc.get("entry_point", ""), str):
      raise error(path, n, "code: 'entry_point' must be a string")
    return doc
  if kind == "dialogue":
    messages = doc.get("messages")
    if not (isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)) or messages[-1]["role"] != "user":
      raise error(path, n, "dialogue: 'messages' must be a non-empty list of {\"role\": str, "
                           "\"content\": str} ending with the user's turn")
    if not isinstance(doc.get("reference"), str):
      raise error(path, n, "dialogue: needs a string field 'reference'")
    return doc
  raise error(path, n, f"unknown task kind {kind!r}")


@dataclasses.dataclass
class Task:
  """A task file read and checked: its docs (and few-shot pool) as dicts."""
  name: str
  path: str
  kind: str
  docs: list
  fewshot_docs: list | None = None
  target_delimiter: str = " "
  fewshot_delimiter: str = "\n\n"
  options: dict = dataclasses.field(default_factory=dict)
  num_fewshot: int = 0  # the task's own few-shot count: used when the caller names none
  sampler: str = "default"  # "default": drawn by seed; "first_n": the pool's first, in order
  # whether a doc drawn as its own few-shot example is dropped (None: when the pool is the docs)
  exclude_doc: bool | None = None


def read_jsonl(path: str) -> list[tuple[int, object]]:
  """(line number, parsed value) of each non-blank line."""
  if not os.path.isfile(path):
    raise config_lib.ConfigError(f"{path}: no such task file")
  out = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
          raise error(path, n, f"not JSON ({e.msg})") from None
  return out


def check_doc(path: str, n: int, doc, kind: str) -> dict:
  """The doc, its fields checked for `kind`; multiple-choice contexts under "context"."""
  if not isinstance(doc, dict):
    raise error(path, n, f"expected a JSON object, got {type(doc).__name__}")
  if kind == "perplexity":
    if not isinstance(doc.get("text"), str) or not doc["text"]:
      raise error(path, n, "perplexity: needs a non-empty string field 'text'")
    return doc
  if kind != "multiple_choice":
    return _check_other(path, n, doc, kind)
  context = doc.get("context", doc.get("query"))
  if not isinstance(context, str):
    raise error(path, n, "multiple_choice: needs a string field 'context' (or 'query')")
  choices = doc.get("choices")
  if not isinstance(choices, list) or not choices:
    raise error(path, n, "multiple_choice: 'choices' must be a non-empty list of strings")
  if not all(isinstance(c, str) and c for c in choices):
    raise error(path, n, "multiple_choice: every choice must be a non-empty string")
  gold = doc.get("gold")
  if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
    raise error(path, n, f"multiple_choice: 'gold' must be an integer in [0, {len(choices)}), "
                          f"got {gold!r}")
  return {**doc, "context": context}
