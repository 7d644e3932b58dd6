"""A generated image-text task (train.task=vlm): one coloured shape (square, circle, triangle,
cross; red, green, blue, yellow) drawn with numpy at a random place and size on a dark, noisy
canvas, and a question about it, "shape?" or "colour?", whose answer is one token. Each row is
drawn from (seed, split, row index) alone, so batches are deterministic, resumable and the eval
split is held out. Without the image the answer is a guess among 4: chance is 1/4.

A row: [BOS, image_token x patches, question, answer]; the model reads it shifted by one
(inputs/targets) and is scored on the answer only (`loss_mask`). Images are float32, [1, S, S, 3]
a row, normalized to [-1, 1].
"""

import numpy as np

from jaxtrain.data.synthetic import SPLITS

PAD, BOS, ASK_SHAPE, ASK_COLOUR = 0, 1, 2, 3
SHAPES = ("square", "circle", "triangle", "cross")
COLOURS = {"red": (0.95, 0.1, 0.1), "green": (0.1, 0.85, 0.1), "blue": (0.15, 0.3, 1.0),
           "yellow": (0.95, 0.9, 0.1)}
FIRST_SHAPE = 4  # shape answers 4..7, colour answers 8..11
FIRST_COLOUR = FIRST_SHAPE + len(SHAPES)
VOCAB = FIRST_COLOUR + len(COLOURS)  # the ids this data emits: 0 .. VOCAB - 1
CHANCE = 1 / len(SHAPES)  # == 1 / len(COLOURS)
QUESTIONS = {"shape?": ASK_SHAPE, "colour?": ASK_COLOUR}
ANSWERS = SHAPES + tuple(COLOURS)  # ids FIRST_SHAPE .. VOCAB - 1


class ShapesTokenizer:
  """The shapes data's words: a question ("shape?" or "colour?") to its id, answer ids to their
  names (other ids as <id>)."""

  bos, eos = BOS, None

  def encode(self, text: str) -> np.ndarray:
    words = text.split()
    unknown = [w for w in words if w not in QUESTIONS]
    if unknown:
      raise ValueError(f"the shapes data asks {' or '.join(map(repr, QUESTIONS))}, not {unknown[0]!r}")
    return np.asarray([QUESTIONS[w] for w in words], np.int32)

  def decode(self, ids) -> str:
    names = {FIRST_SHAPE + i: name for i, name in enumerate(ANSWERS)}
    return " ".join(names.get(int(i), f"<{int(i)}>") for i in np.asarray(ids).ravel())


def row_length(patches: int) -> int:
  """train.seq_len a row needs: BOS, the placeholders and the question (the answer is a target)."""
  return patches + 2


def shape_mask(kind: int, size: int, rng) -> np.ndarray:
  """[size, size] bool: shape `kind` (SHAPES) at a random centre, half-extent 30-45% of the side."""
  r = rng.uniform(0.3, 0.45) * size
  cy, cx = rng.uniform(r, size - r, 2)
  yy, xx = np.mgrid[:size, :size] + 0.5
  dy, dx = (yy - cy) / r, (xx - cx) / r
  masks = (np.maximum(abs(dy), abs(dx)) <= 0.85,  # square, about the circle's area
           dy ** 2 + dx ** 2 <= 1.0,  # circle
           (abs(dy) <= 1) & (abs(dx) <= (dy + 1) / 2),  # triangle, apex up
           ((abs(dx) <= 0.3) | (abs(dy) <= 0.3)) & (abs(dx) <= 1) & (abs(dy) <= 1))  # cross
  return masks[kind]


def example(seed: int, split: str, index: int, size: int, patches: int, image_token: int):
  """(tokens [patches + 3] int32, image [size, size, 3] float32 in [-1, 1]) of row `index`."""
  rng = np.random.default_rng([seed, SPLITS.index(split), index])
  kind, colour, ask_colour = (int(x) for x in rng.integers(0, [len(SHAPES), len(COLOURS), 2]))
  image = rng.uniform(0.0, 0.15, (size, size, 3))
  rgb = np.clip(np.asarray(list(COLOURS.values())[colour]) + rng.uniform(-0.05, 0.05, 3), 0, 1)
  image[shape_mask(kind, size, rng)] = rgb
  answer = FIRST_COLOUR + colour if ask_colour else FIRST_SHAPE + kind
  tokens = [BOS] + [image_token] * patches + [ASK_COLOUR if ask_colour else ASK_SHAPE, answer]
  return np.asarray(tokens, np.int32), (image * 2 - 1).astype(np.float32)


def rows(seed: int, split: str, first: int, n: int, seq_len: int, size: int, patches: int,
         image_token: int) -> dict:
  """Rows first .. first + n - 1 as a batch: inputs, targets, segment_ids, positions (int32 [n, L]),
  loss_mask (float32 [n, L], 1 at the answer) and images (float32 [n, 1, size, size, 3])."""
  inputs = np.full((n, seq_len), PAD, np.int32)
  targets, loss_mask = np.full_like(inputs, PAD), np.zeros((n, seq_len), np.float32)
  images = np.zeros((n, 1, size, size, 3), np.float32)
  for i in range(n):
    tokens, images[i, 0] = example(seed, split, first + i, size, patches, image_token)
    k = len(tokens) - 1
    inputs[i, :k], targets[i, :k] = tokens[:-1], tokens[1:]
    loss_mask[i, k - 1] = 1.0
  return {"inputs": inputs, "targets": targets, "segment_ids": (inputs != PAD).astype(np.int32),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), inputs.shape).copy(),
          "loss_mask": loss_mask, "images": images}


class ShapeBatches:
  """Rows lo:hi of consecutive global batches of `batch_size` rows; the state is the batch count."""

  def __init__(self, seed: int, split: str, lo: int, hi: int, batch_size: int, seq_len: int,
               size: int, patches: int, image_token: int):
    self.args = (seed, split)
    self.lo, self.hi, self.batch_size, self.seq_len = lo, hi, batch_size, seq_len
    self.size, self.patches, self.image_token = size, patches, image_token
    self.index = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    first = self.index * self.batch_size + self.lo
    self.index += 1
    return rows(*self.args, first, self.hi - self.lo, self.seq_len, self.size, self.patches,
                self.image_token)

  def get_state(self) -> dict:
    return {"index": self.index}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])
