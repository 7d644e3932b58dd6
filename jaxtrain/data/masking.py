"""BERT's masking for masked-LM pre-training (Devlin et al., 2019), on the host, over the language
model's packed rows. Numpy only.

Of a row's non-padding tokens each is chosen with `mask_prob`; a chosen token becomes the mask token
(80%), a random other id of the vocabulary (10%) or stays (10%). The masked-LM batch keeps the rows'
segment ids and positions: `inputs` are the corrupted tokens, `targets` the original ones and
`loss_mask` the chosen positions. Row r of global batch i is masked by a generator seeded with (seed,
split, i, r), so a batch is a function of its index: resume is exact, on any process count.

Synthetic data (data/synthetic.py) adds `bound`, per chosen position the loss of an informed
predictor (`copy_bound`), whose mean no model can go below.
"""

import math

import numpy as np

from jaxtrain.data.synthetic import FIRST_SYMBOL, SEP, SPLITS

MASK, RANDOM, KEPT = 1, 2, 3  # what happened to a chosen token (0: not chosen)
_STREAM = 0x4D4C4D  # keeps the masking's random stream apart from the data's


def corrupt(tokens_RL, segment_RL, rows, index: int, seed: int, split: str, mask_prob: float,
            mask_token: int, vocab_size: int):
  """(corrupted tokens, what happened to each token: 0 or MASK, RANDOM, KEPT) of rows `rows` (global
  row numbers) of global batch `index`."""
  out_RL, how_RL = tokens_RL.copy(), np.zeros(tokens_RL.shape, np.int8)
  split_id = SPLITS.index(split)
  for j, row in enumerate(rows):
    rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM, split_id, index, row]))
    n = tokens_RL.shape[1]
    chosen_L = (rng.random(n) < mask_prob) & (segment_RL[j] > 0)
    kind_L = rng.random(n)
    random_L = rng.integers(0, vocab_size - 1, n)
    random_L = random_L + (random_L >= mask_token)  # any id but the mask token
    how_RL[j] = np.where(chosen_L, np.where(kind_L < 0.8, MASK, np.where(kind_L < 0.9, RANDOM,
                                                                         KEPT)), 0)
    out_RL[j] = np.where(how_RL[j] == MASK, mask_token,
                         np.where(how_RL[j] == RANDOM, random_L, tokens_RL[j]))
  return out_RL, how_RL


def copy_bound(tokens_RL, segment_RL, positions_RL, how_RL, symbols: int):
  """[R, L] float32: at each chosen position of synthetic rows, the loss (nats) of a predictor told,
  besides the corrupted row, which tokens were corrupted and how, and every document's structure.

  It knows a chosen token that stayed and the structure tokens (BOS, SEP, EOS); a chosen symbol
  whose copy in the other half lies in the row uncorrupted (not chosen, or chosen and kept) costs
  0; any other chosen symbol is uniform over the symbols not known in its document (a half is
  drawn without replacement): log(symbols - known). More information never raises the best
  expected loss, so the mean of this over the chosen tokens is a lower bound on every model's
  masked-token loss; what it lies below the true floor is what the extra knowledge is worth."""
  bound_RL = np.zeros(tokens_RL.shape, np.float32)
  for r in range(tokens_RL.shape[0]):
    for doc in np.unique(segment_RL[r][segment_RL[r] > 0]):
      at = np.flatnonzero(segment_RL[r] == doc)
      tok, pos, how = tokens_RL[r, at], positions_RL[r, at], how_RL[r, at]
      sep = pos[tok == SEP]
      symbol = tok >= FIRST_SYMBOL
      slot = pos  # each symbol's slot in its half (1..n): the copy's is its position - n - 1
      if len(sep):
        n = int(sep[0]) - 1
        slot = np.where(pos > n + 1, pos - n - 1, pos)
      truthful = (how != MASK) & (how != RANDOM)
      by_slot = {}
      for s, t, ok in zip(slot[symbol], tok[symbol], truthful[symbol]):
        by_slot.setdefault(int(s), []).append((int(t), bool(ok)))
      known = {t for copies in by_slot.values() for t, ok in copies if ok}
      cost = math.log(symbols - len(known)) if len(known) < symbols else 0.0
      for i in np.flatnonzero(symbol & ~truthful):  # chosen, masked or replaced
        partner_ok = any(ok for _, ok in by_slot[int(slot[i])])  # itself is not
        bound_RL[r, at[i]] = 0.0 if partner_ok else cost
  return bound_RL


def mask_batch(batch: dict, rows, index: int, split: str, t, vocab_size: int,
               symbols: int | None = None) -> dict:
  """The masked-LM batch of a language-model batch (`t`: the train section; `symbols`: the synthetic
  language's, which adds `bound`)."""
  tokens_RL, segment_RL = batch["inputs"], batch["segment_ids"]
  mask_token = t.mask_token if t.mask_token >= 0 else vocab_size - 1
  inputs_RL, how_RL = corrupt(tokens_RL, segment_RL, rows, index, t.seed, split, t.mask_prob,
                              mask_token, vocab_size)
  out = {"inputs": inputs_RL, "targets": tokens_RL, "segment_ids": segment_RL,
         "positions": batch["positions"], "loss_mask": (how_RL > 0).astype(np.float32)}
  if symbols is not None:
    out["bound"] = copy_bound(tokens_RL, segment_RL, batch["positions"], how_RL, symbols)
  return out


class MaskedBatches:
  """Masked-LM batches over an iterator of language-model batches (rows lo..hi of each global
  batch); the state is the inner iterator's and the batch count."""

  def __init__(self, inner, lo: int, split: str, t, vocab_size: int, symbols: int | None = None):
    self.inner, self.lo, self.split, self.t = inner, lo, split, t
    self.vocab_size, self.symbols, self.index = vocab_size, symbols, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self.inner)
    rows = range(self.lo, self.lo + len(batch["inputs"]))
    out = mask_batch(batch, rows, self.index, self.split, self.t, self.vocab_size, self.symbols)
    self.index += 1
    return out

  def get_state(self) -> dict:
    return {**self.inner.get_state(), "mlm_index": self.index}

  def set_state(self, state: dict) -> None:
    self.inner.set_state({k: v for k, v in state.items() if k != "mlm_index"})
    self.index = int(state["mlm_index"])

