"""Image-text pairs from JSONL (data/image_text.py): PNG and JPEG decoded, resized and normalized,
missing, truncated, non-image and huge files and bad lines counted and skipped in one report line,
images decoded by the batches' workers (what fails there skipped, the batches resumable), rows that
score the text only, and a vlm run that reads them."""

import json

import jax
import numpy as np
import pytest
from PIL import Image

import jaxtrain
from jaxtrain import builder, config as config_lib
from jaxtrain.data import image_text
from jaxtrain.data.text import BYTE_BOS, BYTE_EOS
from tests.fixtures import tiny_config


def write_pairs(folder) -> str:
  """Six lines: a PNG, a JPEG, a missing file, a truncated PNG, a text file, a line without text."""
  red = np.zeros((12, 20, 3), np.uint8)
  red[..., 0] = 255
  Image.fromarray(red).save(folder / "red.png")
  Image.fromarray(np.full((16, 16), 255, np.uint8)).convert("RGB").save(folder / "white.jpg")
  noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
  Image.fromarray(noise).save(folder / "whole.png")  # its pixel data outlasts the header
  data = (folder / "whole.png").read_bytes()
  (folder / "cut.png").write_bytes(data[:len(data) // 2])
  (folder / "note.png").write_text("not an image")
  lines = [{"image": "red.png", "text": "red"}, {"image": "white.jpg", "text": "white"},
           {"image": "gone.png", "text": "x"}, {"image": "cut.png", "text": "x"},
           {"image": "note.png", "text": "x"}, {"image": "red.png"}]
  path = folder / "pairs.jsonl"
  path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
  return str(path)


def test_good_images_are_read_and_bad_ones_counted_in_one_line(tmp_path):
  path = write_pairs(tmp_path)
  pairs, counts = image_text.read_pairs(path)
  assert pairs == [(str(tmp_path / "red.png"), b"red"), (str(tmp_path / "white.jpg"), b"white")]
  assert counts == {"missing": 1, "truncated": 1, "not_an_image": 1, "huge": 0, "bad_line": 1}
  red, white = (image_text.load_image(p, 8, 3) for p, _ in pairs)
  assert red.shape == (8, 8, 3) and red.dtype == np.float32
  np.testing.assert_allclose(red[..., 0], 1.0)
  np.testing.assert_allclose(red[..., 1:], -1.0)
  np.testing.assert_allclose(white, 1.0, atol=0.02)  # JPEG, lossy
  grey_red, grey_white = (image_text.load_image(p, 4, 1) for p, _ in pairs)
  assert grey_red.shape == (4, 4, 1) and grey_white.min() > 0.95  # channels 1: luminance
  line = image_text.report(path, len(pairs), counts)
  assert line.endswith("2 pairs kept, 4 skipped (1 missing, 1 truncated, 1 not an image, 1 bad line)")
  assert "\n" not in line


def test_a_row_scores_the_text_and_eos_only(tmp_path):
  image = np.zeros((8, 8, 3), np.float32)
  r = image_text.row((image, b"hi"), 10, 4, 300)
  assert list(r["inputs"][:7]) == [BYTE_BOS, 300, 300, 300, 300, ord("h"), ord("i")]
  scored = r["targets"][r["loss_mask"] > 0]
  assert list(scored) == [ord("h"), ord("i"), BYTE_EOS]
  assert list(r["segment_ids"]) == [1] * 7 + [0] * 3 and r["images"].shape == (1, 8, 8, 3)


def test_a_vlm_run_reads_the_pairs_and_reports_the_bad_ones(tmp_path, capsys):
  cfg = tiny_config(model={"vocab_size": 264}, data={"path": write_pairs(tmp_path)},
                    train={"task": "vlm", "seq_len": 12, "steps": 2, "batch_size": 2})
  cfg.model.vision.update(image_size=8, patch_size=4, d_model=16, n_layers=1, n_heads=2)
  final = jaxtrain.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1], progress=False)
  assert final["step"] == 2 and np.isfinite(final["loss"])
  assert "2 pairs kept, 4 skipped" in capsys.readouterr().out
  cfg.model.vision.image_token = 200
  with pytest.raises(config_lib.ConfigError, match="is an id the byte text of image-text pairs"):
    builder.make_task(cfg, "")


def test_huge_images_are_skipped_from_their_header_without_a_warning(tmp_path):
  """Over image_text.HUGE_PIXELS: skipped before decoding; between Pillow's limit and twice it (Pillow
  warns at open) and over twice it (Pillow refuses at open) alike, and no warning escapes."""
  import warnings
  limit = Image.MAX_IMAGE_PIXELS
  sides = {"big.png": 8200, "bigger.png": int((1.5 * limit) ** 0.5), "bomb.png": int((2.2 * limit) ** 0.5)}
  for name, side in sides.items():  # 1-bit, blank: megabytes in memory, kilobytes on disk
    Image.new("1", (side, side)).save(tmp_path / name)
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "small.png")
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps({"image": name, "text": name}) + "\n"
                          for name in ("small.png", *sides)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pairs, counts = image_text.read_pairs(str(path))
  assert [text for _, text in pairs] == [b"small.png"]
  for _, side in sides.items():
    assert side * side > image_text.HUGE_PIXELS
  assert counts["huge"] == 3 and sum(counts.values()) == 3
  assert image_text.report(str(path), 1, counts).endswith("1 pairs kept, 3 skipped (3 huge)")


def test_batches_decode_in_workers_skip_what_fails_late_and_resume(tmp_path, capsys):
  """A truncated JPEG passes the start's check (Pillow's verify reads no JPEG data): its pair is
  skipped for the next when a worker decodes it, with one printed line, the same on every run; a
  resumed iterator continues with the same batches."""
  colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
  for i, rgb in enumerate(colours):
    Image.fromarray(np.full((8, 8, 3), rgb, np.uint8)).save(tmp_path / f"{i}.png")
  noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
  Image.fromarray(noise).save(tmp_path / "whole.jpg")
  data = (tmp_path / "whole.jpg").read_bytes()
  (tmp_path / "cut.jpg").write_bytes(data[:len(data) // 2])
  names = ["0.png", "cut.jpg", "1.png", "2.png", "3.png"]
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps({"image": n, "text": n}) + "\n" for n in names))
  pairs, counts = image_text.read_pairs(str(path))
  assert len(pairs) == 5 and sum(counts.values()) == 0  # verify passes the cut JPEG
  make = lambda: image_text.PairBatches(pairs, 0, 2, 2, 12, 4, 300, 8, 3)  # noqa: E731
  straight = make()
  batches = [next(straight) for _ in range(6)]
  texts = [bytes(b["inputs"][r, 5:10].astype(np.uint8)).rstrip(b"\x00") for b in batches for r in range(2)]
  assert texts[:6] == [b"0.png", b"1.png", b"1.png", b"2.png", b"3.png", b"0.png"]  # cut.jpg -> the next
  red = batches[0]["images"][0, 0]
  np.testing.assert_allclose(red[..., 0], 1.0)
  np.testing.assert_allclose(red[..., 1:], -1.0)
  assert capsys.readouterr().out.count("cut.jpg: truncated when decoded, skipped") == 1
  resumed = make()
  resumed.set_state({"index": 3})
  for want in batches[3:]:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  assert resumed.get_state() == {"index": 6} and straight.get_state() == {"index": 6}
