"""The on-disk token cache that `prepare` writes and the pipeline reads (numpy only).

CACHE/
  manifest.json   {"fingerprint", "num_docs", "num_tokens", "dtype", "vocab_size", "complete", ...}
                  prepare adds "source" (the data.path entry), "format" and "tokenizer" (its spec)
  report.json     the data report of prepare (jaxtrain/data/report.py), written before the manifest
  tokens.bin      every document's token ids, concatenated (BOS/EOS already in place), dtype as
                  named
  offsets.npy     int64 [num_docs + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
  shards-KEY/     prepare's finished shards while it runs (prepare.py, shards.py); removed once the
                  cache is complete

A cache is valid only when manifest.json exists with "complete": true; it is written last, after
the arrays, by an atomic rename, so a killed `prepare` never leaves a cache that looks finished.
"""

import json
import os

import numpy as np

MANIFEST = "manifest.json"


def token_dtype(vocab_size: int):
  return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def write_cache(path: str, docs, vocab_size: int, fingerprint: str, **meta) -> dict:
  """Writes documents (iterable of int arrays) as a complete cache; returns the manifest."""
  dtype = token_dtype(vocab_size)
  chunks = ((np.asarray(doc, dtype), [len(doc)]) for doc in docs)
  return write_chunks(path, chunks, vocab_size, fingerprint, **meta)


def write_chunks(path: str, chunks, vocab_size: int, fingerprint: str, **meta) -> dict:
  """Like write_cache from (tokens, lengths) chunks: each is len(lengths) documents back to back."""
  os.makedirs(path, exist_ok=True)
  dtype = token_dtype(vocab_size)
  lengths = []
  with open(os.path.join(path, "tokens.bin.tmp"), "wb") as f:
    for tokens, chunk_lengths in chunks:
      f.write(np.asarray(tokens, dtype).tobytes())
      lengths.append(np.asarray(chunk_lengths, np.int64))
  lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
  offsets = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  np.save(os.path.join(path, "offsets.npy.tmp.npy"), offsets)
  os.replace(os.path.join(path, "tokens.bin.tmp"), os.path.join(path, "tokens.bin"))
  os.replace(os.path.join(path, "offsets.npy.tmp.npy"), os.path.join(path, "offsets.npy"))
  manifest = {"fingerprint": fingerprint, "num_docs": len(lengths), "num_tokens": int(offsets[-1]),
              "dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "complete": True, **meta}
  tmp = os.path.join(path, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=2)
  os.replace(tmp, os.path.join(path, MANIFEST))
  return manifest


def read_manifest(path: str) -> dict | None:
  """The manifest of a complete cache, or None when absent or incomplete."""
  try:
    with open(os.path.join(path, MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  return manifest if manifest.get("complete") else None


class Cache:
  """Random access to the documents of a complete cache, memory-mapped."""

  def __init__(self, path: str):
    self.manifest = read_manifest(path)
    if self.manifest is None:
      raise FileNotFoundError(
          f"no complete token cache in {path}; run `python -m jaxtrain prepare` first")
    self.offsets = np.load(os.path.join(path, "offsets.npy"))
    n = self.manifest["num_tokens"]
    dtype = np.dtype(self.manifest["dtype"])
    self.tokens = (np.memmap(os.path.join(path, "tokens.bin"), dtype, mode="r", shape=(n,)) if n
                   else np.zeros(0, dtype))

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, i: int) -> np.ndarray:
    return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]], np.int32)
