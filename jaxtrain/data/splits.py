"""Which tokens of a token cache are held out for evaluation, and their pieces. Numpy only.

By documents whenever that gives each split a next-token pair: document i is held out when
splitmix64(i) / 2**64 < eval_fraction, so a document keeps its split as the corpus grows, and with 2
or more documents neither split is empty. Otherwise (one document, or documents too short) the tail
of the token stream is held out: ceil(eval_fraction * tokens) tokens, and at least min_eval_tokens
(the pipeline asks for one batch of pairs) while that leaves training half the tokens. The cut falls
inside a document: its two parts share no token, and the pair across the cut is in neither split.
Fewer than 4 tokens cannot be split: all of them train and the eval split is empty.
"""

import math
from typing import NamedTuple

import numpy as np


class Split(NamedTuple):
  """Token ranges [start, stop) of each split, one row per range; tail: tokens held out at the end
  (0: by documents)."""
  train: np.ndarray
  eval: np.ndarray
  tail: int


def _splitmix64(x):
  """Steele et al. (2014) SplitMix64 finalizer over a uint64 array: a fixed, well-mixed hash."""
  with np.errstate(over="ignore"):
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def eval_mask(num_docs: int, eval_fraction: float) -> np.ndarray:
  """[num_docs] True for held-out documents: splitmix64(index) / 2**64 < eval_fraction.

  With eval_fraction > 0 and at least 2 documents, neither split is empty.
  """
  u = _splitmix64(np.arange(num_docs, dtype=np.uint64)) / 2.0**64
  held = u < eval_fraction
  if eval_fraction > 0 and num_docs >= 2:
    held[np.argmin(u)] = True
    held[np.argmax(u)] = False
  return held


def pairs(ranges: np.ndarray) -> int:
  """Next-token pairs in token ranges."""
  return int(np.maximum(ranges[:, 1] - ranges[:, 0] - 1, 0).sum())


def _clip(ranges: np.ndarray, lo: int, hi: int) -> np.ndarray:
  """The non-empty parts of ranges within [lo, hi)."""
  out = np.stack([np.maximum(ranges[:, 0], lo), np.minimum(ranges[:, 1], hi)], 1)
  return out[out[:, 1] > out[:, 0]]


def split(offsets: np.ndarray, eval_fraction: float, min_eval_tokens: int) -> Split:
  """The train and eval token ranges of a cache with these document offsets, by the rules above."""
  docs = np.stack([offsets[:-1], offsets[1:]], 1).astype(np.int64)
  held = eval_mask(len(docs), eval_fraction)
  if eval_fraction == 0 or (pairs(docs[held]) and pairs(docs[~held])):
    return Split(docs[~held], docs[held], 0)
  total = int(offsets[-1])
  tail = min(max(math.ceil(eval_fraction * total), min(min_eval_tokens, total // 2)), total - 2)
  if tail < 2:
    return Split(docs, docs[:0], 0)
  return Split(_clip(docs, 0, total - tail), _clip(docs, total - tail, total), tail)


def cut_pieces(ranges: np.ndarray, seq_len: int):
  """(first token index, next-token pairs) of every piece of the ranges, in order: piece k of a
  range covers its tokens [k*L, k*L + L + 1), so consecutive pieces share one token and lose no
  pair."""
  starts, n = ranges[:, 0], ranges[:, 1] - ranges[:, 0] - 1
  starts, n = starts[n >= 1], n[n >= 1]  # a 1-token range has no target
  counts = -(-n // seq_len)
  doc = np.repeat(np.arange(len(n)), counts)
  k = np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)
  return starts[doc] + k * seq_len, np.minimum(seq_len, n[doc] - k * seq_len).astype(np.int32)
