"""BERT's masking on the host: its rates, determinism by (seed, split, batch, row), padding never
chosen, exact resume, and the informed predictor's bound on hand-made documents."""

import math

import ml_collections
import numpy as np

from jaxtrain.data import SyntheticLanguage, IndexedIterator
from jaxtrain.data.masking import KEPT, MASK, RANDOM, MaskedBatches, copy_bound, corrupt

VOCAB = 64


def test_rates_are_berts_and_padding_is_never_chosen():
  tokens = np.random.default_rng(0).integers(0, VOCAB - 1, (64, 256)).astype(np.int32)
  segment = np.ones_like(tokens)
  segment[:, -16:] = 0
  out, how = corrupt(tokens, segment, range(64), 0, 0, "train", 0.15, VOCAB - 1, VOCAB)
  chosen = how > 0
  assert not chosen[segment == 0].any()
  assert abs(chosen[segment > 0].mean() - 0.15) < 0.01
  share = {k: (how[chosen] == k).mean() for k in (MASK, RANDOM, KEPT)}
  assert abs(share[MASK] - 0.8) < 0.02 and abs(share[RANDOM] - 0.1) < 0.015
  np.testing.assert_array_equal(out[how == MASK], VOCAB - 1)
  np.testing.assert_array_equal(out[how == KEPT], tokens[how == KEPT])
  np.testing.assert_array_equal(out[how == 0], tokens[how == 0])
  assert (out[how == RANDOM] != VOCAB - 1).all()


def test_a_row_is_masked_the_same_whoever_holds_it():
  tokens = np.arange(8 * 32, dtype=np.int32).reshape(8, 32) % 50
  segment = np.ones_like(tokens)
  whole = corrupt(tokens, segment, range(8), 3, 7, "train", 0.15, 63, VOCAB)
  half = corrupt(tokens[4:], segment[4:], range(4, 8), 3, 7, "train", 0.15, 63, VOCAB)
  np.testing.assert_array_equal(whole[0][4:], half[0])
  other = corrupt(tokens, segment, range(8), 4, 7, "train", 0.15, 63, VOCAB)  # next batch
  assert (other[1] != whole[1]).any()


def train_section(**kw):
  return ml_collections.ConfigDict({"seed": 0, "mask_prob": 0.15, "mask_token": -1, **kw})


def test_state_resumes_the_same_batches():
  source = SyntheticLanguage(40, 0.2, 12, 32, 0, "train")
  make = lambda: MaskedBatches(IndexedIterator(source, 0, 4), 0, "train", train_section(), VOCAB,  # noqa: E731
                               40)
  a = make()
  next(a), next(a)
  state = a.get_state()
  want = next(a)
  b = make()
  b.set_state(state)
  got = next(b)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])
  assert set(want) == {"inputs", "targets", "segment_ids", "positions", "loss_mask", "bound"}


def test_copy_bound_on_a_hand_made_document():
  # BOS 10 11 12 SEP 10 11 12 EOS: symbols 10, 11, 12 are ids 14, 15, 16 (FIRST_SYMBOL 4)
  tokens = np.array([[1, 14, 15, 16, 2, 14, 15, 16, 3]], np.int32)
  positions = np.arange(9)[None]
  segment = np.ones_like(tokens)
  how = np.zeros_like(tokens, dtype=np.int8)
  how[0, 1] = MASK  # its copy (position 5) is visible: 0
  how[0, 2] = how[0, 6] = MASK  # both copies of 11 masked: a guess among 20 - {10, 12}
  how[0, 3] = KEPT  # kept: known
  how[0, 4] = MASK  # SEP: structure, known
  bound = copy_bound(tokens, segment, positions, how, symbols=20)
  want = np.zeros(9, np.float32)
  want[2] = want[6] = math.log(18)
  np.testing.assert_allclose(bound[0], want, rtol=1e-6)
  how[0, 7] = RANDOM  # 12's copy replaced: 12 still known from its kept first copy
  assert copy_bound(tokens, segment, positions, how, symbols=20)[0, 7] == 0.0
