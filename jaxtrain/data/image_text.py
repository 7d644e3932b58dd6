"""Image-text pairs from JSONL (train.task=vlm with data.path): one object a line, {"image": a PNG or
JPEG path (relative to the JSONL file's folder), "text": its caption}.

At the start each image is checked without decoding its pixels (exists, is an image, at most
HUGE_PIXELS, and passes Pillow's `verify`: a PNG's chunks and checksums); a pair whose image fails, or
whose line is not such an object, is counted and skipped, and `report` says so in one line. Only the
paths and captions stay in memory. The images are decoded by Pillow in the batch pipeline's worker
threads (grain, prefetched), converted to RGB (channels 3) or grey (1), resized to image_size^2 and
normalized to [-1, 1]; an image that fails there (a truncated JPEG passes `verify`) is skipped for the
next pair in order, the same on every run, with one printed line. The text is bytes (data's
ByteTokenizer).

A row: [BOS, image_token x patches, text bytes, EOS], cut to seq_len + 1; every text target is
scored. Every tenth pair (index 9, 19, ...) is the eval split, the rest train (with fewer than ten
pairs both splits read them all); a split's rows repeat its pairs in order.
"""

import json
import os
import threading
import warnings
import weakref

import grain
import numpy as np
from PIL import Image, UnidentifiedImageError

from jaxtrain.data.pipeline import close_iterators
from jaxtrain.data.text import BYTE_BOS, BYTE_EOS

REASONS = ("missing", "truncated", "not_an_image", "huge", "bad_line")
# an image over this many pixels is skipped as huge before it is decoded (a decompression bomb, or a
# scan far beyond any image_size)
HUGE_PIXELS = 8192 * 8192
PAD = 0  # a padding input; its segment id 0 keeps it out of attention and the loss


class BadImage(Exception):
  """An image that cannot be used; `reason` is one of REASONS."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def _with_image(path: str, use):
  """use(the opened image) once it is known not huge (HUGE_PIXELS, from the header); Pillow's errors
  as BadImage: missing, not_an_image, huge, truncated (broken data or checksums)."""
  try:
    with warnings.catch_warnings():  # Pillow warns at open above its limit; such an image is huge here
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)
      image = Image.open(path)
    with image:
      if image.width * image.height > HUGE_PIXELS:
        raise BadImage("huge")
      return use(image)
  except FileNotFoundError:
    raise BadImage("missing") from None
  except UnidentifiedImageError:
    raise BadImage("not_an_image") from None
  except Image.DecompressionBombError:  # Pillow refuses at open over twice its own limit
    raise BadImage("huge") from None
  except (OSError, SyntaxError):  # "image file is truncated", broken streams; verify's checksums
    raise BadImage("truncated") from None


def load_image(path: str, size: int, channels: int) -> np.ndarray:
  """float32 [size, size, channels] in [-1, 1]; BadImage for a missing, truncated, non-image or
  huge file."""
  def decode(image):
    image.load()
    return image.convert("RGB" if channels == 3 else "L").resize((size, size), Image.BICUBIC)
  x = np.asarray(_with_image(path, decode), np.float32).reshape(size, size, channels) / 255.0
  return x * 2 - 1


def check_image(path: str) -> None:
  """BadImage for a missing, non-image, huge or (by Pillow's `verify`) truncated file; the pixels are
  not decoded."""
  _with_image(path, lambda image: image.verify())


def read_pairs(path: str):
  """([(image path, text bytes)], counts by reason of REASONS) of the JSONL file `path`, each image
  checked (check_image), none decoded."""
  pairs, counts = [], dict.fromkeys(REASONS, 0)
  folder = os.path.dirname(path)
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        image_path, text = record["image"], record["text"]
        if not isinstance(image_path, str) or not isinstance(text, str):
          raise TypeError
      except (ValueError, KeyError, TypeError):
        counts["bad_line"] += 1
        continue
      image_path = os.path.join(folder, image_path)
      try:
        check_image(image_path)
      except BadImage as e:
        counts[e.reason] += 1
        continue
      pairs.append((image_path, text.encode("utf-8")))
  return pairs, counts


def report(path: str, kept: int, counts: dict) -> str:
  """One line: pairs kept and skipped, by reason."""
  skipped = sum(counts.values())
  why = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n)
  return f"image-text {path}: {kept} pairs kept, {skipped} skipped" + (f" ({why})" if why else "")


def split_pairs(pairs: list, split: str) -> list:
  """The pairs of `split`: every tenth pair is eval (all pairs when there are fewer than ten)."""
  if len(pairs) < 10:
    return pairs
  return [p for i, p in enumerate(pairs) if (i % 10 == 9) == (split == "eval")]


def row(image_text, seq_len: int, patches: int, image_token: int) -> dict:
  """One row of a batch from (image, text bytes): inputs, targets, segment_ids, positions, loss_mask
  ([seq_len]) and images ([1, H, W, C])."""
  image, text = image_text
  tokens = np.asarray([BYTE_BOS] + [image_token] * patches + list(text) + [BYTE_EOS],
                      np.int32)[:seq_len + 1]
  k = len(tokens) - 1
  inputs, targets = np.full(seq_len, PAD, np.int32), np.full(seq_len, PAD, np.int32)
  inputs[:k], targets[:k] = tokens[:-1], tokens[1:]
  loss_mask = np.zeros(seq_len, np.float32)
  loss_mask[patches:k] = 1.0  # the text's bytes and EOS
  return {"inputs": inputs, "targets": targets, "segment_ids": (np.arange(seq_len) < k).astype(np.int32),
          "positions": np.arange(seq_len, dtype=np.int32), "loss_mask": loss_mask,
          "images": image[None]}


class PairBatches:
  """Rows lo:hi of consecutive global batches of `batch_size` rows over `pairs` ((image path, text
  bytes)), in order and repeated; the images decoded by `threads` worker threads, `prefetch` batches
  ahead. The state is the batch count."""

  def __init__(self, pairs: list, lo: int, hi: int, batch_size: int, seq_len: int, patches: int,
               image_token: int, size: int, channels: int, threads: int = 2, prefetch: int = 2):
    self.pairs, self.lo, self.hi, self.batch_size = pairs, lo, hi, batch_size
    self.seq_len, self.patches, self.image_token = seq_len, patches, image_token
    self.size, self.channels = size, channels
    self._skipped, self._lock = set(), threading.Lock()
    self._ds = grain.MapDataset.range(0, 2 ** 62).map(self._batch).to_iter_dataset(
        grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch))
    self._its = [iter(self._ds)]
    # the worker threads stopped when the batches are dropped or at exit (as data/pipeline.py's)
    self.close = weakref.finalize(self, close_iterators, self._its)

  def _batch(self, index: int) -> dict:
    first = index * self.batch_size + self.lo
    rows = [row(self._decoded(first + i), self.seq_len, self.patches, self.image_token)
            for i in range(self.hi - self.lo)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def _decoded(self, k: int):
    """(pixels, text) of pair k, or of the next pair in order whose image decodes."""
    n = len(self.pairs)
    for j in range(n):
      image_path, text = self.pairs[(k + j) % n]
      try:
        return load_image(image_path, self.size, self.channels), text
      except BadImage as e:
        with self._lock:
          if image_path not in self._skipped:
            self._skipped.add(image_path)
            print(f"image-text: {image_path}: {e.reason.replace('_', ' ')} when decoded, skipped "
                  "for the next pair", flush=True)
    raise ValueError(f"image-text: none of the {n} images decodes")

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._its[0])

  def get_state(self) -> dict:
    return {"index": int(self._its[0].get_state()["next_index"])}

  def set_state(self, state: dict) -> None:
    self._its[0].set_state({"next_index": int(state["index"])})
