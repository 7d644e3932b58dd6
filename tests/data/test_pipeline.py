"""TextPipeline: packing loses and repeats no next-token pair, splits are disjoint, batches are
deterministic and do not depend on the process count, and a state resumes exactly (in a fresh
process, under another process count). Corpora are tiny caches in tmp dirs.

Most tests use a corpus whose tokens are unique and consecutive within a document (document d is
s_d+1 .. s_d+n_d), so a real pair is exactly one with target == input + 1, and its input names
the document and the position in it.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxtrain.data.cache import write_cache
from jaxtrain.data.pipeline import TextPipeline
from jaxtrain.data.splits import eval_mask

from tests.fixtures import ROOT
SEQ, ROWS = 16, 4
INT_KEYS = ("inputs", "targets", "segment_ids", "positions")


def unique_docs(num_docs, max_len, seed):
  """Documents of 1..max_len tokens (many longer than SEQ + 1), every token id distinct and > 0."""
  lengths = np.random.default_rng(seed).integers(1, max_len + 1, num_docs)
  ends = np.cumsum(lengths)
  return [np.arange(e - n, e) + 1 for e, n in zip(ends, lengths)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  docs = unique_docs(150, 3 * SEQ + 3, seed=0)
  path = str(tmp_path_factory.mktemp("unique"))
  write_cache(path, docs, vocab_size=2**16, fingerprint="unique")
  return path, docs


def args(path, **kw):
  return {"caches": [path], "weights": None, "seq_len": SEQ, "batch_size": ROWS, "seed": 3, "split": "train",
          "eval_fraction": 0.2, **kw}


def check_batch(b, rows=ROWS):
  """The batch contract: shapes, dtypes, padding, segments numbered from 1, positions from 0."""
  assert sorted(b) == sorted(INT_KEYS + ("loss_mask",))
  for k in INT_KEYS:
    assert b[k].shape == (rows, SEQ) and b[k].dtype == np.int32, k
  assert b["loss_mask"].dtype == np.float32
  seg, pos = b["segment_ids"], b["positions"]
  real = seg > 0
  np.testing.assert_array_equal(b["loss_mask"], real)
  for k in ("inputs", "targets", "positions"):
    assert not b[k][~real].any(), k
  assert (np.diff(real.astype(int), axis=1) <= 0).all()  # padding only at the end of a row
  assert (seg[:, 0] == 1).all()
  step = np.diff(seg, axis=1)[real[:, 1:]]
  assert np.isin(step, (0, 1)).all()
  new = np.diff(seg, axis=1) == 1
  np.testing.assert_array_equal(pos[:, 1:][new], 0)
  same = (np.diff(seg, axis=1) == 0) & real[:, 1:]
  np.testing.assert_array_equal(pos[:, 1:][same], pos[:, :-1][same] + 1)
  # Within a segment the target is the next input: no target crosses a segment.
  np.testing.assert_array_equal(b["targets"][:, :-1][same], b["inputs"][:, 1:][same])


def check_pieces(b, docs):
  """Every real pair is a next-token pair, and each segment is piece k of a document: it starts at
  token k*SEQ of the document and holds min(SEQ, pairs left) pairs."""
  real = b["segment_ids"] > 0
  np.testing.assert_array_equal(b["targets"][real], b["inputs"][real] + 1)
  starts = np.array([d[0] for d in docs])
  lengths = np.array([len(d) for d in docs])
  for r in range(len(real)):
    for s in np.unique(b["segment_ids"][r][real[r]]):
      tokens = b["inputs"][r][b["segment_ids"][r] == s]
      d = np.searchsorted(starts, tokens[0], side="right") - 1
      k, rest = divmod(int(tokens[0] - starts[d]), SEQ)
      assert rest == 0 and len(tokens) == min(SEQ, lengths[d] - 1 - k * SEQ)


def pairs_of(b) -> np.ndarray:
  """The real pairs of a batch, named by their input (unique corpus)."""
  return b["inputs"][b["segment_ids"] > 0]


def first_epoch(pipeline, docs=None, max_batches=400) -> np.ndarray:
  """The pairs of all batches up to and including the first one that repeats a pair.

  Epochs are permutations of the same pieces and packing keeps stream order, so when the pipeline
  is right that batch crosses into epoch 2 and these are exactly the first epoch's pairs; a piece
  lost, or repeated before the epoch ends, leaves the set incomplete.
  """
  seen = []
  for _ in range(max_batches):
    b = next(pipeline)
    check_batch(b, len(b["inputs"]))
    if docs is not None:
      check_pieces(b, docs)
    new = pairs_of(b)
    repeats = np.intersect1d(np.concatenate(seen) if seen else new[:0], new).size or len(np.unique(new)) < len(new)
    seen.append(new)
    if repeats:
      return np.unique(np.concatenate(seen))
  raise AssertionError(f"no epoch boundary within {max_batches} batches")


def doc_pairs(docs) -> np.ndarray:
  return np.concatenate([d[:-1] for d in docs])


@pytest.mark.parametrize("packing", ["first_fit", "best_fit"])
def test_packing_loses_and_repeats_no_pair(corpus, packing):
  path, docs = corpus
  train = first_epoch(TextPipeline(**args(path, packing=packing)), docs)
  held = first_epoch(TextPipeline(**args(path, split="eval", packing=packing)), docs)
  everything = doc_pairs(docs)
  # train and eval together hold every pair of the corpus exactly once, whole documents each
  assert np.intersect1d(train, held).size == 0
  np.testing.assert_array_equal(np.union1d(train, held), np.unique(everything))
  for d in docs:
    assert np.isin(d[:-1], train).all() or np.isin(d[:-1], held).all()
  assert 0 < held.size < train.size


def test_same_seed_same_batches_other_seed_differs(corpus):
  path, _ = corpus
  a, b, c = (TextPipeline(**args(path, seed=s)) for s in (3, 3, 4))
  for _ in range(6):
    x, y, z = next(a), next(b), next(c)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert not np.array_equal(x["inputs"], z["inputs"])


def test_processes_split_global_batches(corpus):
  """Process i of 2 gets rows [2i, 2i+2) of the one-process global batch: disjoint, together all."""
  path, docs = corpus
  one = TextPipeline(**args(path))
  two = [TextPipeline(**args(path, process_index=i, process_count=2)) for i in range(2)]
  seen = [np.zeros(0, np.int32), np.zeros(0, np.int32)]
  for _ in range(400):
    full, parts = next(one), [next(t) for t in two]
    for k in full:
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])
    new = [pairs_of(p) for p in parts]
    for p in parts:
      check_batch(p, ROWS // 2)
    if np.intersect1d(np.concatenate(seen), np.concatenate(new)).size:
      break  # this batch crosses into the second epoch
    assert np.intersect1d(new[0], new[1]).size == 0
    seen = [np.concatenate([s, x]) for s, x in zip(seen, new)]
  assert np.intersect1d(seen[0], seen[1]).size == 0  # disjoint over the first epoch
  epoch = np.unique(np.concatenate(seen + new))
  train = first_epoch(TextPipeline(**args(path)))
  np.testing.assert_array_equal(epoch, train)  # together: every training pair
  assert two[0].get_state() == two[1].get_state() == one.get_state()


def test_eval_mask_is_deterministic_and_sized():
  n, f = 100_000, 0.1
  m = eval_mask(n, f)
  np.testing.assert_array_equal(m, eval_mask(n, f))
  assert abs(m.mean() - f) < 4 * np.sqrt(f * (1 - f) / n)  # binomial, 4 sigma
  assert eval_mask(2, 1e-9).sum() == 1  # neither split empty when there are 2 documents
  assert not eval_mask(50, 0.0).any()
  # A larger corpus keeps each document's assignment (it depends on the index only).
  np.testing.assert_array_equal(eval_mask(1000, f)[:500], eval_mask(500, f))


def test_eval_stream_ignores_training_seed_and_rewinds(corpus):
  """Every evaluation can read the same first batches: rewind to the state taken at the start."""
  path, _ = corpus
  a, b = (TextPipeline(**args(path, split="eval", seed=s)) for s in (1, 2))
  start = a.get_state()
  first = [next(a) for _ in range(3)]
  a.set_state(start)
  for x in first:
    y, z = next(a), next(b)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
      np.testing.assert_array_equal(x[k], z[k])


def test_set_state_rewinds_and_checks_the_stream(corpus):
  path, _ = corpus
  p = TextPipeline(**args(path))
  for _ in range(5):
    next(p)
  time.sleep(0.3)  # the prefetch thread runs ahead: the state must be that of the batches consumed
  state = p.get_state()
  assert json.loads(json.dumps(state)) == state
  want = [next(p) for _ in range(4)]
  p.set_state(state)  # rewind a running, prefetching iterator
  for w in want:
    got = next(p)
    for k in w:
      np.testing.assert_array_equal(got[k], w[k])
  # Another global batch size: packing restarts at the first piece not yet consumed (row 0, segment 1).
  bigger = TextPipeline(**args(path, batch_size=2 * ROWS))
  bigger.set_state(state)
  first = next(bigger)
  n = int((want[0]["segment_ids"][0] == 1).sum())
  np.testing.assert_array_equal(first["inputs"][0, :n], want[0]["inputs"][0, :n])
  assert (first["segment_ids"][0] == 1).sum() == n
  with pytest.raises(ValueError, match="seed: 3 -> 4"):
    TextPipeline(**args(path, seed=4)).set_state(state)


def test_resume_in_fresh_process_under_any_process_count(corpus, tmp_path):
  path, _ = corpus
  k, n = 7, 6
  ref = TextPipeline(**args(path))
  want = [next(ref) for _ in range(k + n)][k:]
  saver = TextPipeline(**args(path, process_index=0, process_count=2))
  for _ in range(k):
    next(saver)
  time.sleep(0.3)  # let the prefetch thread run ahead
  state = saver.get_state()
  jobs = [(1, 0), (2, 1), (4, 3)]  # (process_count, process_index) of the restoring process
  spec = [{"pipeline": args(path, process_count=c, process_index=i), "state": state, "batches": n,
           "out": str(tmp_path / f"{c}_{i}")} for c, i in jobs]
  with open(tmp_path / "jobs.json", "w") as f:
    json.dump(spec, f)
  env = {**os.environ, "PYTHONPATH": ROOT}
  worker = os.path.join(ROOT, "tests", "data", "pipeline_worker.py")
  run = subprocess.run([sys.executable, worker, str(tmp_path / "jobs.json")], env=env, capture_output=True, text=True,
                       timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  for (c, i), job in zip(jobs, spec):
    lo, hi = i * ROWS // c, (i + 1) * ROWS // c
    for b in range(n):
      for key in want[b]:
        got = np.load(os.path.join(job["out"], f"{b}_{key}.npy"))
        np.testing.assert_array_equal(got, want[b][key][lo:hi], err_msg=f"{c} processes, batch {b}, {key}")


def test_mixture_follows_weights(tmp_path):
  """Weights 3:1 over two caches of equal document lengths (tokens 10..149 vs 150..299)."""
  rng = np.random.default_rng(1)
  lengths = rng.integers(2, 2 * SEQ, 300)  # one piece per document at seq_len 2*SEQ
  paths = []
  for name, lo, hi in (("a", 10, 150), ("b", 150, 300)):
    paths.append(str(tmp_path / name))
    write_cache(paths[-1], [rng.integers(lo, hi, n) for n in lengths], 300, name)
  kw = {"caches": paths, "weights": [3.0, 1.0], "seq_len": 2 * SEQ, "batch_size": 8, "seed": 0, "split": "train",
        "eval_fraction": 0.1}
  p, q = TextPipeline(**kw), TextPipeline(**kw)
  pieces, tokens = np.zeros(2), np.zeros(2)
  for _ in range(80):
    b = next(p)
    for key, value in next(q).items():
      np.testing.assert_array_equal(value, b[key])
    real = b["segment_ids"] > 0
    from_a = b["targets"] < 150
    tokens += [(real & from_a).sum(), (real & ~from_a).sum()]
    starts = real & (b["positions"] == 0)
    pieces += [(starts & from_a).sum(), (starts & ~from_a).sum()]
  # grain interleaves by exact proportions: 3 pieces of a per piece of b, up to the last few.
  assert abs(pieces[0] - 3 * pieces[1]) <= 4, pieces
  # Token share: both caches draw lengths from one list, so the share is 3/4 up to sampling error
  # of the mean piece length; delta method on f = 3x / (3x + y), 4 standard errors.
  sd = np.std(lengths - 1)
  x, y = tokens / pieces
  se = 3 / (3 * x + y) ** 2 * np.hypot(y * sd / np.sqrt(pieces[0]), x * sd / np.sqrt(pieces[1]))
  share = tokens[0] / tokens.sum()
  assert abs(share - 0.75) < 4 * se, (share, se)
  assert tokens.sum() > 10_000


def test_mixture_without_weights_is_by_size(tmp_path):
  """weights=None: each training piece of the union equally likely, as if the caches were one."""
  rng = np.random.default_rng(2)
  sizes = {"a": 300, "b": 100}
  paths = []
  for (name, n), lo in zip(sizes.items(), (10, 150)):
    paths.append(str(tmp_path / name))
    write_cache(paths[-1], [rng.integers(lo, lo + 140, rng.integers(2, SEQ)) for _ in range(n)], 300, name)
  p = TextPipeline(paths, None, seq_len=SEQ, batch_size=8, seed=0, split="train", eval_fraction=0.1)
  from_a = total = 0
  for _ in range(60):
    b = next(p)
    starts = (b["segment_ids"] > 0) & (b["positions"] == 0)  # one per piece
    from_a += (starts & (b["inputs"] < 150)).sum()
    total += starts.sum()
  train = [int((~eval_mask(n, 0.1)).sum()) for n in sizes.values()]  # documents of 2..SEQ tokens: one piece each
  # Exact interleaving at grain's integer proportions (1% resolution), up to the last few pieces.
  assert abs(from_a / total - train[0] / sum(train)) < 0.01 + 4 / total, (from_a, total, train)


def test_bad_arguments_fail_with_one_line(corpus):
  path, _ = corpus
  with pytest.raises(ValueError, match="dividing batch_size"):
    TextPipeline(**args(path, process_count=3))
  with pytest.raises(ValueError, match="packing"):
    TextPipeline(**args(path, packing="worst_fit"))
  with pytest.raises(ValueError, match="eval_fraction"):
    TextPipeline(**args(path, split="eval", eval_fraction=0.0))
