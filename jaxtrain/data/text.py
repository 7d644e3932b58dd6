"""Byte-level text: a tokenizer and local files packed into fixed-length rows. Numpy only.

Each file is one document, BOS + UTF-8 bytes + EOS. Epoch e shuffles the split's documents into one
stream and cuts it into windows of seq_len next-token pairs (one token of overlap, as in nanoGPT).
"""

import glob
import os
import pathlib
import zlib

import numpy as np

BYTE_BOS, BYTE_EOS, BYTE_VOCAB = 256, 257, 258
SPLITS = ("train", "eval")
_GLOB_CHARS = "*?["


class ByteTokenizer:
  """ids 0..255 are bytes, 256 is BOS, 257 is EOS."""

  bos, eos, vocab_size = BYTE_BOS, BYTE_EOS, BYTE_VOCAB

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Drops ids outside 0..255 (BOS, EOS, padding past the vocab) and replaces invalid UTF-8."""
    ids = np.asarray(ids).ravel()
    raw = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
    return raw.decode("utf-8", errors="replace")


def _is_hidden(rel: str) -> bool:
  return any(part.startswith(".") for part in pathlib.PurePath(rel).parts)


def list_documents(path: str) -> list[tuple[str, str]]:
  """Sorted (name, file) pairs for a file, a directory (recursive, hidden entries skipped), a glob.

  The name is the path relative to the directory or the glob's fixed prefix; it decides the split.
  """
  if os.path.isfile(path):
    return [(os.path.basename(path), path)]
  if os.path.isdir(path):
    files = [str(p) for p in pathlib.Path(path).rglob("*") if p.is_file()]
    pairs = [(pathlib.Path(os.path.relpath(f, path)).as_posix(), f) for f in files]
    pairs = sorted(p for p in pairs if not _is_hidden(p[0]))
    if not pairs:
      raise ValueError(f"data.path {path!r} is a directory without files")
    return pairs
  if not any(c in path for c in _GLOB_CHARS):
    raise FileNotFoundError(f"data.path {path!r} does not exist")
  files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(f"data.path {path!r} matches no files")
  fixed = path[:min(path.index(c) for c in _GLOB_CHARS if c in path)]
  root = os.path.dirname(fixed) or "."
  return [(pathlib.Path(os.path.relpath(f, root)).as_posix(), f) for f in files]


def eval_flags(names: list[str], eval_fraction: float) -> list[bool]:
  """True for held-out documents, crc32(name) / 2**32 < eval_fraction; no empty split if >= 2."""
  u = [zlib.crc32(n.encode("utf-8")) / 2**32 for n in names]
  flags = [x < eval_fraction for x in u]
  if len(names) >= 2 and not any(flags):
    flags[int(np.argmin(u))] = True
  if len(names) >= 2 and all(flags):
    flags[int(np.argmax(u))] = False
  return flags


def read_document(file: str) -> np.ndarray:
  """BOS + the file's bytes + EOS, uint16."""
  raw = np.fromfile(file, np.uint8).astype(np.uint16)
  return np.concatenate([[BYTE_BOS], raw, [BYTE_EOS]]).astype(np.uint16)


class ByteCorpus:
  """Global row r of batch i is window i*batch_size + r, counted over successive epochs."""

  vocab_size = BYTE_VOCAB

  def __init__(self, path, seq_len, seed, split, eval_fraction, batch_size):
    if split not in SPLITS:
      raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if seq_len < 1 or batch_size < 1:
      raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    if not 0 <= eval_fraction < 1:
      raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    pairs = list_documents(str(path))
    flags = eval_flags([name for name, _ in pairs], eval_fraction)
    chosen = [pair for pair, f in zip(pairs, flags) if f == (split == "eval")]
    if not chosen:
      raise ValueError(f"data.path {str(path)!r}: the {split} split is empty "
                       f"({len(pairs)} file(s); a held-out split needs at least 2)")
    self.names = [name for name, _ in chosen]
    self.seq_len, self.seed, self.split, self.batch_size = seq_len, seed, split, batch_size
    self._split_id = SPLITS.index(split)
    self._docs = [read_document(f) for _, f in chosen]
    self._lengths = np.array([len(d) for d in self._docs])
    self.tokens_per_epoch = int(self._lengths.sum())
    self.windows_per_epoch = (self.tokens_per_epoch - 2) // seq_len + 1  # covers N-1 pairs
    self._cache = {}

  def epoch_stream(self, epoch: int):
    """(stream [N] uint16, document starts, document ends) of an epoch; the last two are cached."""
    if epoch not in self._cache:
      rng = np.random.default_rng(np.random.SeedSequence([self.seed, self._split_id, epoch]))
      order = rng.permutation(len(self._docs))
      stream = np.concatenate([self._docs[i] for i in order])
      lengths = self._lengths[order]
      ends = np.cumsum(lengths)
      if len(self._cache) >= 2:
        self._cache.pop(next(iter(self._cache)))
      self._cache[epoch] = (stream, ends - lengths, ends)
    return self._cache[epoch]

  def batch(self, index: int, lo: int, hi: int) -> dict:
    """Rows lo..hi-1 of global batch `index`, each [rows, seq_len]."""
    if index < 0 or not 0 <= lo <= hi <= self.batch_size:
      raise ValueError(f"need index >= 0 and 0 <= lo <= hi <= {self.batch_size}, "
                       f"got index={index}, lo={lo}, hi={hi}")
    shape = (hi - lo, self.seq_len)
    out = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    out["loss_mask"] = np.zeros(shape, np.float32)
    for i, r in enumerate(range(lo, hi)):
      self._fill_row(out, i, index * self.batch_size + r)
    return out

  def _fill_row(self, out, i, window):
    """Writes window number `window` (over successive epochs) into row i; pairs past the end pad."""
    epoch, k = divmod(window, self.windows_per_epoch)
    stream, starts, ends = self.epoch_stream(epoch)
    t = k * self.seq_len + np.arange(self.seq_len)
    valid = t < len(stream) - 1
    t = t[valid]
    doc = np.searchsorted(starts, t, side="right") - 1
    out["inputs"][i, valid] = stream[t]
    out["targets"][i, valid] = stream[t + 1]
    out["segment_ids"][i, valid] = doc - doc[0] + 1
    out["positions"][i, valid] = t - starts[doc]
    out["loss_mask"][i, valid] = t + 1 < ends[doc]
