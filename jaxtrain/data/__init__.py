"""Host-side batches (numpy only): a synthetic copy language and byte-level text files.

A batch is a dict of [rows, seq_len] arrays: inputs, targets, segment_ids, positions (int32) and
loss_mask (float32); synthetic batches add entropy (float32). `source.batch(index, lo, hi)` builds
rows lo..hi-1 of global batch `index`, so each host can build only its own slice.
"""

from jaxtrain.data.synthetic import (BOS, EOS, FIRST_SYMBOL, PAD, SEP, SymbolTokenizer,
                                     SyntheticLanguage, entropy_floor)
from jaxtrain.data.text import BYTE_BOS, BYTE_EOS, BYTE_VOCAB, ByteCorpus, ByteTokenizer


def _synthetic(cfg, split):
  d, t = cfg.data, cfg.train
  return SyntheticLanguage(d.symbols, d.stop_prob, d.max_symbols, t.seq_len, t.seed, split)


def _bytes(cfg, split):
  d, t = cfg.data, cfg.train
  return ByteCorpus(d.path, t.seq_len, t.seed, split, d.eval_fraction, t.batch_size)


SOURCES = {"synthetic": _synthetic, "bytes": _bytes}


def make_source(cfg, split: str):
  """The batch source that cfg.data.kind names, for split "train" or "eval"."""
  if cfg.data.kind not in SOURCES:
    choices = ", ".join(SOURCES)
    raise ValueError(f"data.kind: unknown value {cfg.data.kind!r}; choose one of {choices}")
  return SOURCES[cfg.data.kind](cfg, split)


class IndexedIterator:
  """Rows lo..hi of consecutive global batches of a random-access source; the state is the index."""

  def __init__(self, source, lo: int, hi: int, index: int = 0):
    self.source, self.lo, self.hi, self.index = source, lo, hi, index

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = self.source.batch(self.index, self.lo, self.hi)
    self.index += 1
    return batch

  def get_state(self) -> dict:
    return {"index": self.index}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])


def make_iterator(cfg, split: str, lo: int, hi: int) -> IndexedIterator:
  """This process's rows lo..hi of each global batch of `split`, with get_state/set_state."""
  return IndexedIterator(make_source(cfg, split), lo, hi)


def make_tokenizer(cfg):
  """The tokenizer that turns prompts into ids and samples back into text for cfg.data.kind."""
  tokenizers = {"synthetic": lambda: SymbolTokenizer(cfg.data.symbols), "bytes": ByteTokenizer}
  return tokenizers[cfg.data.kind]()


__all__ = ["BOS", "BYTE_BOS", "BYTE_EOS", "BYTE_VOCAB", "ByteCorpus", "ByteTokenizer", "EOS",
           "FIRST_SYMBOL", "PAD", "SEP", "SymbolTokenizer", "SyntheticLanguage", "entropy_floor", "IndexedIterator", "make_iterator", "make_source",
           "make_tokenizer"]
