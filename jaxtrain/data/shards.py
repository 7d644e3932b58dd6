"""One shard of a cache being prepared: tokenized (in a worker or in prepare itself), written whole
as one .npz, read back. Numpy only: a worker child (workers.py) imports this, not prepare.
"""

import json
import os
from typing import NamedTuple

import numpy as np

from jaxtrain.data import cache as cache_lib
from jaxtrain.data import report as report_lib
from jaxtrain.data import sources


class Rules(NamedTuple):
  """What, besides files and tokenizer, decides a cache's content (from data.*:
  prepare.rules_of)."""
  fmt: str
  text_field: str
  add_bos: bool
  add_eos: bool
  bad_utf8: str


def tokenize_shard(tokenizer, pieces: list, rules: Rules) -> tuple[np.ndarray, np.ndarray, dict]:
  """(tokens of all usable documents back to back, their lengths, counts), BOS/EOS by the rules."""
  counts = report_lib.new_counts()
  head = np.array([tokenizer.bos] if rules.add_bos else [], np.int32)
  tail = np.array([tokenizer.eos] if rules.add_eos else [], np.int32)
  parts, lengths = [], []
  for text in sources.iter_texts(pieces, rules.text_field, rules.bad_utf8, counts):
    ids = np.asarray(tokenizer.encode(text), np.int32)
    parts += [head, ids, tail]
    lengths.append(len(head) + len(ids) + len(tail))
  tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
    raise ValueError(f"tokenizer produced ids outside 0..{tokenizer.vocab_size - 1}")
  counts["tokens"] = int(tokens.size)
  tokens = tokens.astype(cache_lib.token_dtype(tokenizer.vocab_size))
  return tokens, np.array(lengths, np.int64), counts


def write_shard(path: str, tokens, lengths, counts) -> None:
  """One .npz, renamed into place whole: a reader sees all of it or nothing."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    np.savez(f, tokens=tokens, lengths=lengths, counts=np.array(json.dumps(counts)))
  os.replace(tmp, path)


def shard_counts(path: str) -> dict | None:
  """A finished shard's counts, or None when it is missing or unreadable (then it is redone)."""
  try:
    with np.load(path) as z:
      return json.loads(str(z["counts"]))
  except (OSError, ValueError, KeyError, EOFError):
    return None


def shard_chunks(paths):
  """(tokens, lengths) of each shard, in order."""
  for path in paths:
    with np.load(path) as z:
      yield z["tokens"], z["lengths"]


def run_shard(tokenizer, index, pieces, rules, path):
  """Tokenizes and writes one shard; (index, counts)."""
  tokens, lengths, counts = tokenize_shard(tokenizer, pieces, rules)
  write_shard(path, tokens, lengths, counts)
  return index, counts
