"""Tokenizers: round trips, compression, determinism, reload by spec and reference, file formats."""

import json
import pickle
import random
import shutil

import numpy as np
import pytest
import sentencepiece
import tokenizers

from jaxtrain.config import default_config
from jaxtrain.data.text import ByteTokenizer
from jaxtrain.data.tokenizers import (Bytes, HfTokenizer, SentencePieceTokenizer, load_reference,
                                      load_tokenizer, make_tokenizer, save_reference, train_bpe)

WORDS = ("the cat sat on the mat and the dog ran far away from the house while it was raining "
         "outside in the garden where children played with their small red ball").split()
EXTRAS = ["café crème brûlée naïve", "日本語のテキストです。", "emoji 🙂🚀👍🏽 and ZWJ 👩‍👩‍👧",
          "\ttabs\tand\nnewlines\r\n", "  leading and trailing spaces  ", "<eos> <bos> <pad> as text",
          "", "Ω≈ç√∫ µ≤≥÷", "\x00\x01 control \x7f"]


def english(n_docs: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(n_docs)]


def random_unicode(rng: random.Random, n: int) -> str:
  """Code points from all planes (mostly BMP), surrogates excluded."""
  out = []
  while len(out) < n:
    c = rng.choice((rng.randint(0x20, 0x7F), rng.randint(0, 0xFFFF), rng.randint(0, 0x10FFFF)))
    if not 0xD800 <= c <= 0xDFFF:
      out.append(chr(c))
  return "".join(out)


CORPUS = english(400) + EXTRAS * 5


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  return train_bpe(iter(CORPUS), 400, str(tmp_path_factory.mktemp("bpe") / "tokenizer.json"))


def data_cfg(**values):
  d = default_config().data
  d.update(values)
  return d


def test_bpe_round_trips_written_and_random_text(bpe):
  rng = random.Random(0)
  texts = EXTRAS + english(5, seed=1) + [random_unicode(rng, rng.randint(0, 80)) for _ in range(300)]
  for ids, text in zip(bpe.encode_batch(texts), texts):
    single = bpe.encode(text)
    assert single.dtype == np.int32 and np.array_equal(ids, single)
    assert bpe.decode(ids) == text
    assert not np.isin(ids, [bpe.bos, bpe.eos]).any()  # special names in the text stay text
  assert bpe.decode(np.concatenate([[bpe.bos], bpe.encode("a b"), [bpe.eos, 2, 2]])) == "a b"


def test_bpe_layout_and_compression(bpe):
  vocab = json.load(open(bpe.path))["model"]["vocab"]
  assert (bpe.bos, bpe.eos, vocab.get("<pad>")) == (0, 1, 2)
  assert 300 < bpe.vocab_size <= 400
  text = " ".join(english(20, seed=2))
  assert len(bpe.encode(text)) < len(text.encode()) / 2


def test_bpe_training_is_deterministic(tmp_path, bpe):
  again = train_bpe(iter(CORPUS), 400, str(tmp_path / "again.json"))
  assert open(again.path, "rb").read() == open(bpe.path, "rb").read()
  assert again.fingerprint() == bpe.fingerprint()
  with pytest.raises(ValueError, match="below 259"):
    train_bpe(iter(CORPUS), 100, str(tmp_path / "small.json"))


def test_reload_by_spec_and_reference_gives_same_ids(tmp_path, bpe):
  texts = EXTRAS + english(3, seed=3)
  for tok in (bpe, Bytes()):
    spec = json.loads(json.dumps(tok.spec()))
    workdir = tmp_path / tok.spec()["kind"]
    save_reference(tok, str(workdir))
    for again in (load_tokenizer(spec), load_reference(str(workdir)), pickle.loads(pickle.dumps(tok))):
      assert (again.bos, again.eos, again.vocab_size) == (tok.bos, tok.eos, tok.vocab_size)
      assert again.fingerprint() == tok.fingerprint()
      for a, b in zip(again.encode_batch(texts), tok.encode_batch(texts)):
        assert np.array_equal(a, b)


def test_reference_inside_workdir_survives_a_move_and_notices_a_changed_file(tmp_path):
  workdir = tmp_path / "run"
  tok = make_tokenizer(data_cfg(tokenizer="bpe", bpe_vocab_size=300), str(workdir), iter(CORPUS))
  save_reference(tok, str(workdir))
  assert json.load(open(workdir / "tokenizer_ref.json"))["spec"] == {"kind": "hf", "path": "tokenizer.json"}
  shutil.move(workdir, tmp_path / "moved")
  moved = load_reference(str(tmp_path / "moved"))
  assert np.array_equal(moved.encode("the garden"), tok.encode("the garden"))
  train_bpe(iter(CORPUS[:50]), 300, str(tmp_path / "moved" / "tokenizer.json"))
  with pytest.raises(ValueError, match="changed since") as err:
    load_reference(str(tmp_path / "moved"))
  assert "\n" not in str(err.value)


def test_make_tokenizer_byte_bpe_and_paths(tmp_path):
  byte = make_tokenizer(data_cfg(tokenizer="byte"), str(tmp_path))
  assert (byte.bos, byte.eos, byte.vocab_size, byte.spec()) == (256, 257, 258, {"kind": "byte"})
  text = "héllo 🙂"
  assert np.array_equal(byte.encode(text), ByteTokenizer().encode(text))
  assert byte.decode(byte.encode(text)) == text
  assert byte.decode([256, 0xFF, 104, 257]) == "\ufffdh"
  cfg = data_cfg(tokenizer="bpe", bpe_vocab_size=320)
  with pytest.raises(ValueError, match="no texts"):
    make_tokenizer(cfg, str(tmp_path))
  trained = make_tokenizer(cfg, str(tmp_path), iter(CORPUS))
  assert trained.spec() == {"kind": "hf", "path": str(tmp_path / "tokenizer.json")}
  reused = make_tokenizer(cfg, str(tmp_path), texts=["different text entirely"])  # loads, no retraining
  assert reused.fingerprint() == trained.fingerprint()
  with pytest.raises(ValueError, match="delete it to retrain"):
    make_tokenizer(data_cfg(tokenizer="bpe", bpe_vocab_size=300), str(tmp_path))
  by_path = make_tokenizer(data_cfg(tokenizer=str(tmp_path / "tokenizer.json")), str(tmp_path / "other"))
  assert by_path.fingerprint() == trained.fingerprint()


def test_tokenizer_json_from_the_library_loads_by_path(tmp_path):
  """A WordLevel tokenizer.json whose <s> </s> are plain vocab entries, not marked special."""
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  loaded = make_tokenizer(data_cfg(tokenizer=str(tmp_path / "tokenizer.json")), str(tmp_path))
  assert isinstance(loaded, HfTokenizer) and (loaded.bos, loaded.eos, loaded.vocab_size) == (1, 2, 5)
  assert loaded.encode("hello world hello").tolist() == [3, 4, 3]
  assert loaded.decode([1, 3, 4, 2]) == "hello world"
  no_specials = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
  no_specials.save(str(tmp_path / "plain.json"))
  with pytest.raises(ValueError, match="no BOS/EOS") as err:
    make_tokenizer(data_cfg(tokenizer=str(tmp_path / "plain.json")), str(tmp_path))
  assert "\n" not in str(err.value)


def test_sentencepiece_model_matches_sentencepiece(tmp_path):
  (tmp_path / "corpus.txt").write_text("\n".join(CORPUS), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
      input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=400,
      model_type="bpe", byte_fallback=True, normalization_rule_name="identity", hard_vocab_limit=False,
      num_threads=1, minloglevel=2)
  path = str(tmp_path / "sp.model")
  tok = make_tokenizer(data_cfg(tokenizer=path), str(tmp_path))
  sp = sentencepiece.SentencePieceProcessor(model_file=path)
  assert isinstance(tok, SentencePieceTokenizer) and tok.spec() == {"kind": "sentencepiece", "path": path}
  assert (tok.bos, tok.eos, tok.vocab_size) == (sp.bos_id(), sp.eos_id(), sp.get_piece_size())
  texts = english(5, seed=4) + ["café crème 日本語 🙂 Ω", "<s> and </s> as text", "zebra quokka"]
  for ids, text in zip(tok.encode_batch(texts), texts):
    assert ids.dtype == np.int32 and ids.tolist() == sp.encode(text, out_type=int)
    assert tok.decode(ids) == text and tok.decode(np.concatenate([[tok.bos], ids, [tok.eos]])) == text
    assert not np.isin(ids, [tok.bos, tok.eos]).any()
  for again in (load_tokenizer(tok.spec()), pickle.loads(pickle.dumps(tok))):
    assert np.array_equal(again.encode(texts[-2]), tok.encode(texts[-2]))


def test_fingerprint_follows_file_contents_not_path_or_time(tmp_path, bpe):
  copy = tmp_path / "copy.json"
  shutil.copy(bpe.path, copy)
  assert HfTokenizer(str(copy)).fingerprint() == bpe.fingerprint()
  assert Bytes().fingerprint() == Bytes().fingerprint() != bpe.fingerprint()
  spec = json.loads(copy.read_text())
  spec["model"]["vocab"]["Ġthe"], spec["model"]["vocab"]["Ġcat"] = (spec["model"]["vocab"]["Ġcat"],
                                                                   spec["model"]["vocab"]["Ġthe"])
  copy.write_text(json.dumps(spec))
  assert HfTokenizer(str(copy)).fingerprint() != bpe.fingerprint()


@pytest.mark.parametrize("call", [
    lambda d: make_tokenizer(data_cfg(tokenizer=str(d / "missing.json")), str(d)),
    lambda d: make_tokenizer(data_cfg(tokenizer=str(d / "missing.model")), str(d)),
    lambda d: load_tokenizer({"kind": "hf", "path": str(d / "gone.json")}),
    lambda d: load_reference(str(d / "no_run")),
])
def test_missing_files_raise_one_line(tmp_path, call):
  with pytest.raises(FileNotFoundError) as err:
    call(tmp_path)
  assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)
