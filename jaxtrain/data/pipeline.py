"""Token caches -> packed, shuffled, checkpointable batches with grain. Numpy and grain only.

Each cache's split (splits.py: held-out documents, or a token tail of a one-document corpus) is cut
into pieces of at most seq_len + 1 tokens (piece k of a document covers tokens [k*L, k*L + L + 1),
so consecutive pieces share one token and no next-token pair is lost). The pieces of each cache are
shuffled with the seed, reshuffled every epoch (grain's index_shuffle with seed + epoch), mixed by
weight and packed first-fit or best-fit into rows of seq_len pairs, one global batch of bins at a
time; every piece is its own segment.

Every process packs the whole global stream, but a piece is packed as the indices of its tokens, not
the tokens, so packing costs no reads; a process then reads only the tokens of its own rows. The
state (grain's, a few integers) is therefore the same on every process and independent of
process_count: global batches are identical for any process count, and a state saved by P processes
restores exactly under any P' that divides batch_size. Shape letters: jaxtrain/model/axes.py.
"""

import json
import weakref

import grain
import numpy as np
from grain import experimental as grain_exp

from jaxtrain.data import splits
from jaxtrain.data.cache import Cache

SPLITS = ("train", "eval")
PACKERS = {"first_fit": grain_exp.FirstFitPackIterDataset,
           "best_fit": grain_exp.BestFitPackIterDataset}
EVAL_SEED = 0  # the held-out stream does not depend on the training seed: runs compare on one set
STATE_VERSION = 1
# Changing any of these changes the stream itself, so a saved state cannot continue it.
STREAM_KEYS = ("caches", "weights", "seq_len", "seed", "split", "eval_fraction", "packing",
               "holdout")


class _Pieces:
  """Random-access source: piece i -> {"token": global indices of its input tokens}."""

  def __init__(self, starts, pairs):
    self.starts, self.pairs = starts, pairs

  def __len__(self):
    return len(self.starts)

  def __getitem__(self, i):
    start = int(self.starts[i])
    return {"token": np.arange(start, start + int(self.pairs[i]), dtype=np.int64)}


def _seed32(*words) -> int:
  return int(np.random.SeedSequence(list(words)).generate_state(1)[0])


def _jsonable(x):
  """x with numpy scalars as Python numbers; anything else JSON cannot store is an error,
  not a guess."""
  def default(o):
    if isinstance(o, np.generic):
      return o.item()
    raise TypeError(f"data iterator state holds a {type(o).__name__}, which JSON cannot store")
  return json.loads(json.dumps(x, default=default))


class _RowReader:
  """One packed global batch (a list of rows of token indices) -> this process's rows,
  as a batch."""

  def __init__(self, caches: list[Cache], lo: int, hi: int):
    self.caches, self.lo, self.hi = caches, lo, hi
    # one index space
    self.bases = np.cumsum([0] + [len(c.tokens) for c in caches]).astype(np.int64)

  def __call__(self, rows: list[dict]) -> dict:
    mine = rows[self.lo:self.hi]
    token_RL = np.stack([r["token"] for r in mine])
    segment_ids = np.stack([r["token_segment_ids"] for r in mine]).astype(np.int32)
    real = segment_ids > 0
    return {"inputs": self.gather(token_RL, real), "targets": self.gather(token_RL + 1, real),
            "segment_ids": segment_ids,
            "positions": np.stack([r["token_positions"] for r in mine]).astype(np.int32),
            "loss_mask": real.astype(np.float32)}

  def gather(self, index_RL, real_RL) -> np.ndarray:
    """Tokens at global indices, 0 where not real (padding)."""
    out = np.zeros(index_RL.shape, np.int32)
    which = np.searchsorted(self.bases, index_RL, side="right") - 1
    for c, cache in enumerate(self.caches):
      take = real_RL & (which == c)
      if take.any():
        out[take] = cache.tokens[index_RL[take] - self.bases[c]]
    return out


class TextPipeline:
  """This process's rows of successive global batches of packed documents, checkpointable.

  close() stops the prefetch thread; dropping the pipeline or exiting does it too.
  """

  def __init__(self, caches: list[str], weights: list[float] | None, seq_len: int, batch_size: int,
               seed: int, split: str, eval_fraction: float, packing: str = "first_fit",
               process_index: int = 0, process_count: int = 1, prefetch: int = 2):
    _check_args(caches, weights, seq_len, batch_size, split, eval_fraction, packing, process_index,
                process_count, prefetch)
    self._caches = [Cache(path) for path in caches]
    self.seq_len, self.batch_size = int(seq_len), int(batch_size)
    rows = batch_size // process_count
    reader = _RowReader(self._caches, process_index * rows, (process_index + 1) * rows)
    # One batch of held-out pairs where a cache must be split by tokens; train and eval compute the
    # same.
    cuts = [splits.split(c.offsets, eval_fraction, self.batch_size * self.seq_len + 1)
            for c in self._caches]
    self._config = {"caches": [c.manifest["fingerprint"] for c in self._caches], "weights": weights,
                    "seq_len": self.seq_len, "seed": int(seed), "split": split,
                    "eval_fraction": float(eval_fraction), "packing": packing,
                    "holdout": ([cut.tail for cut in cuts] if any(cut.tail for cut in cuts)
                                else None)}
    stream = self._stream(caches, cuts, weights, seed, split, reader.bases)
    packed = PACKERS[packing](stream.to_iter_dataset(grain.ReadOptions(num_threads=0)),
                              length_struct={"token": self.seq_len},
                              num_packing_bins=self.batch_size, shuffle_bins=False)
    ds = packed.batch(self.batch_size, batch_fn=reader)  # one packing group == one global batch
    if prefetch:
      ds = grain_exp.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    self._its = [iter(ds)]
    # Stop the prefetch thread when the pipeline is dropped or at exit: a daemon thread still
    # running at interpreter shutdown aborts the process ("terminate called without an active
    # exception").
    self.close = weakref.finalize(self, close_iterators, self._its)

  def _stream(self, paths, cuts, weights, seed, split, bases) -> grain.MapDataset:
    """The infinite mixed stream of pieces of the split, each cache reshuffled every epoch."""
    parts, sizes = [], []
    for c, cache in enumerate(self._caches):
      starts, pairs = splits.cut_pieces(cuts[c].eval if split == "eval" else cuts[c].train,
                                        self.seq_len)
      if not len(starts):
        fix = " or set --config.train.eval_every=0" if split == "eval" else ""
        raise ValueError(
            f"cache {paths[c]}: too little text for a {split} split ({len(cache)} document(s), "
            f"{len(cache.tokens)} tokens); add text{fix}")
      shuffle_seed = _seed32(seed, c) if split == "train" else _seed32(EVAL_SEED, c)
      source = _Pieces(starts + bases[c], pairs)
      parts.append(grain.MapDataset.source(source).shuffle(seed=shuffle_seed).repeat())
      sizes.append(len(starts))
    if len(parts) == 1:
      return parts[0]
    # No weights: as if the caches were concatenated, each piece equally likely.
    return grain.MapDataset.mix(parts, weights or sizes)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._its[0])

  def get_state(self) -> dict:
    """Small and JSON-serializable; the same on every process of a run."""
    return {"version": STATE_VERSION, "stream": _jsonable(self._config),
            "grain": _jsonable(self._its[0].get_state())}

  def set_state(self, state: dict) -> None:
    """Continues exactly after the saved batch, under any process_count dividing batch_size.

    With another batch_size, packing restarts at the first piece the saved run had not consumed; but
    a cache split by tokens (a "holdout" tail of one batch) is then split elsewhere, and the state
    refused.
    """
    if state.get("version") != STATE_VERSION:
      raise ValueError(
          f"data iterator state version {state.get('version')!r}; this code reads {STATE_VERSION}")
    mine = _jsonable(self._config)
    changed = [k for k in STREAM_KEYS if state["stream"].get(k) != mine[k]]
    if changed:
      diff = "; ".join(f"{k}: {state['stream'].get(k)!r} -> {mine[k]!r}" for k in changed)
      raise ValueError(f"data iterator state is for another stream ({diff})")
    self._its[0].set_state(state["grain"])


def close_iterators(its: list):
  """Closes the iterator and drops it while grain's modules are still loaded
  (its __del__ closes again)."""
  if its:
    its.pop().close()


def _check_args(caches, weights, seq_len, batch_size, split, eval_fraction, packing, process_index,
                process_count, prefetch):
  """One-line ValueErrors for arguments that cannot make a stream."""
  if not caches:
    raise ValueError("data: need at least one token cache")
  if weights is not None and (len(weights) != len(caches) or any(not w > 0 for w in weights)):
    raise ValueError(
        f"data.weights must be {len(caches)} positive numbers (one per cache), got {weights}")
  if split not in SPLITS:
    raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
  if packing not in PACKERS:
    raise ValueError(f"packing must be one of {', '.join(PACKERS)}, got {packing!r}")
  if seq_len < 1 or batch_size < 1 or prefetch < 0:
    raise ValueError(f"need seq_len >= 1, batch_size >= 1, prefetch >= 0; "
                     f"got {seq_len}, {batch_size}, {prefetch}")
  if not 0 <= eval_fraction < 1 or (split == "eval" and eval_fraction == 0):
    raise ValueError(
        f"eval_fraction must be in [0, 1) and > 0 for the eval split, got {eval_fraction}")
  if not 0 <= process_index < process_count or batch_size % process_count:
    raise ValueError(
        f"need 0 <= process_index < process_count dividing batch_size; got process_index="
        f"{process_index}, process_count={process_count}, batch_size={batch_size}")
