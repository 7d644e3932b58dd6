"""A synthetic language that needs attention, with an exact entropy floor. Numpy only.

A document is BOS x_1..x_n SEP x_1..x_n EOS: a random half of n distinct symbols, then its copy.
The half is unpredictable and the copy is determined by it, so a model that copies perfectly
reaches `expected_entropy_floor()` nats per token, and no model can go below it.
Shape letters: see jaxtrain/model/axes.py (rows here are seq_len + 1 tokens long).
"""

import math

import numpy as np

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4
SPLITS = ("train", "eval")


def half_entropy(symbols: int, stop_prob: float, max_symbols: int) -> np.ndarray:
  """[Y+1] entropy (nats) of the token after BOS and 0..Y symbols of the random half."""
  p = stop_prob
  binary = -p * math.log(p) - (1 - p) * math.log1p(-p)
  h = np.empty(max_symbols + 1)
  h[0] = math.log(symbols)  # the first symbol: uniform, the half is never empty
  k = np.arange(1, max_symbols)
  h[1:max_symbols] = binary + (1 - p) * np.log(symbols - k)  # SEP, or one of S-k unused symbols
  h[max_symbols] = 0.0  # SEP is forced at n = M
  return h


def entropy_floor(batches) -> float:
  """sum(entropy * loss_mask) / sum(loss_mask) over synthetic batches: the best achievable loss."""
  num = den = 0.0
  for b in batches:
    num += float(np.sum(b["entropy"].astype(np.float64) * b["loss_mask"]))
    den += float(np.sum(b["loss_mask"], dtype=np.float64))
  return num / den


class SymbolTokenizer:
  """Text form of the synthetic language: symbols as numbers, BOS '<', SEP '|', EOS '>'."""

  _SPECIAL = {"<": BOS, "|": SEP, ">": EOS}

  def __init__(self, symbols: int):
    self.symbols = symbols
    self.bos, self.eos = BOS, EOS

  def encode(self, text: str) -> np.ndarray:
    ids = []
    for word in text.replace("<", " < ").replace("|", " | ").replace(">", " > ").split():
      if word in self._SPECIAL:
        ids.append(self._SPECIAL[word])
      elif word.isdigit() and int(word) < self.symbols:
        ids.append(FIRST_SYMBOL + int(word))
      else:
        raise ValueError(
            f"synthetic prompt: {word!r} is not a symbol 0..{self.symbols - 1}, '<', '|' or '>'")
    return np.asarray(ids, np.int32)

  def decode(self, ids) -> str:
    names = {v: k for k, v in self._SPECIAL.items()}
    return " ".join(names.get(int(i), str(int(i) - FIRST_SYMBOL)) for i in np.asarray(ids).ravel()
                    if int(i) != PAD)


class SyntheticLanguage:
  """Rows of concatenated documents; row r of batch i depends only on (seed, split, i, r)."""

  def __init__(self, symbols, stop_prob, max_symbols, seq_len, seed, split):
    if split not in SPLITS:
      raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 0 < stop_prob < 1:
      raise ValueError(f"stop_prob must be in (0, 1), got {stop_prob}")
    if not 1 <= max_symbols <= symbols:
      raise ValueError(f"max_symbols must be in [1, symbols={symbols}], got {max_symbols}")
    if seq_len < 1:
      raise ValueError(f"seq_len must be positive, got {seq_len}")
    self.symbols, self.max_symbols = int(symbols), int(max_symbols)
    self.stop_prob = float(stop_prob)
    self.seq_len, self.seed, self.split = int(seq_len), int(seed), split
    self.vocab_size = FIRST_SYMBOL + self.symbols
    self._split_id = SPLITS.index(split)
    self._half_h = half_entropy(self.symbols, self.stop_prob, self.max_symbols)
    self._max_docs = (self.seq_len + 1) // 5 + 1  # the shortest document has 5 tokens

  def batch(self, index: int, lo: int, hi: int) -> dict:
    """Rows lo..hi-1 of global batch `index`, each [rows, seq_len]."""
    if not 0 <= lo <= hi:
      raise ValueError(f"need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    draws = [self._draw(index, r) for r in range(lo, hi)]
    ns_RW = np.array([d[0] for d in draws], np.int64).reshape(hi - lo, self._max_docs)
    halves_RWY = np.array([d[1] for d in draws], np.int32)
    halves_RWY = halves_RWY.reshape(ns_RW.shape + (self.max_symbols,))
    tokens, doc, pos, entropy = self._assemble(ns_RW, halves_RWY)
    batch = {
        "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
        "segment_ids": doc[:, :-1] + 1, "positions": pos[:, :-1],
        "loss_mask": (pos[:, 1:] > 0).astype(np.float32),  # position 0: the next document's BOS
        "entropy": entropy[:, 1:].astype(np.float32),
    }
    return {k: np.ascontiguousarray(v) for k, v in batch.items()}

  def _draw(self, index, row):
    """Half lengths [W] and symbols [W, Y] of a row's documents, from (seed, split, index, row)."""
    rng = np.random.default_rng(np.random.SeedSequence([self.seed, self._split_id, index, row]))
    ns = np.minimum(rng.geometric(self.stop_prob, self._max_docs), self.max_symbols)
    count = int(np.searchsorted(np.cumsum(2 * ns + 3), self.seq_len + 1)) + 1  # documents that fit
    halves = np.zeros((self._max_docs, self.max_symbols), np.int32)
    alphabet = np.broadcast_to(np.arange(self.symbols), (count, self.symbols))
    halves[:count] = rng.permuted(alphabet, axis=1)[:, :self.max_symbols]  # without replacement
    return ns, halves + FIRST_SYMBOL

  def _assemble(self, ns_RW, halves_RWY):
    """Rows of seq_len+1 tokens [R, L] with document index, position in it and entropy."""
    lengths_RW = 2 * ns_RW + 3
    ends_RW = np.cumsum(lengths_RW, axis=1)
    t_L = np.arange(self.seq_len + 1)
    doc_RL = (t_L[None, None, :] >= ends_RW[:, :, None]).sum(axis=1)
    pos_RL = t_L - np.take_along_axis(ends_RW - lengths_RW, doc_RL, axis=1)
    n_RL = np.take_along_axis(ns_RW, doc_RL, axis=1)
    slot_RL = np.where(pos_RL <= n_RL, pos_RL - 1, pos_RL - n_RL - 2).clip(0, self.max_symbols - 1)
    symbol_RL = halves_RWY[np.arange(len(ns_RW))[:, None], doc_RL, slot_RL]
    tokens_RL = np.where(pos_RL == 0, BOS, np.where(pos_RL == n_RL + 1, SEP, symbol_RL))
    tokens_RL = np.where(pos_RL == 2 * n_RL + 2, EOS, tokens_RL).astype(np.int32)
    in_half = (pos_RL >= 1) & (pos_RL <= n_RL + 1)  # the half's symbols and SEP carry entropy
    entropy_RL = np.where(in_half, self._half_h[(pos_RL - 1).clip(0, self.max_symbols)], 0.0)
    return tokens_RL, doc_RL.astype(np.int32), pos_RL.astype(np.int32), entropy_RL

  def expected_entropy_floor(self) -> float:
    """E[sum entropy*mask] / E[sum mask] per row, exact, by a dynamic program over document phase.

    States: 0 BOS emitted; k = 1..Y after k half symbols; Y+1+r while r copies remain (SEP or
    copies emitted); 2Y+2 EOS emitted. Each row starts in state 0 and makes seq_len moves.
    """
    m, p = self.max_symbols, self.stop_prob
    half_h = self._half_h
    z = 2 * m + 3
    move = np.zeros((z, z))
    h = np.zeros(z)  # entropy of the token emitted on leaving each state
    move[0, 1], h[0] = 1.0, half_h[0]
    for k in range(1, m + 1):
      h[k] = half_h[k]
      if k < m:
        move[k, k + 1] = 1 - p
      move[k, m + 1 + k] = p if k < m else 1.0  # SEP; then k copies remain
    for r in range(1, m + 1):
      move[m + 1 + r, m + r] = 1.0
    move[m + 1, z - 1] = 1.0  # no copies left: EOS
    move[z - 1, 0] = 1.0  # the next document's BOS, a masked target
    mask = np.ones(z)
    mask[z - 1] = 0.0
    dist = np.zeros(z)
    dist[0] = 1.0
    num = den = 0.0
    for _ in range(self.seq_len):
      num += dist @ h
      den += dist @ mask
      dist = dist @ move
    return num / den
