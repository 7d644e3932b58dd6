"""Tokenizers for text data: bytes, a byte-level BPE trained on the corpus, or a file. Numpy only.

Each has encode (no BOS/EOS), encode_batch, decode (drops special ids), bos, eos, vocab_size, spec()
(a small dict that load_tokenizer rebuilds it from) and fingerprint() (a hash of what fixes the
ids). A run records spec and fingerprint in WORKDIR/tokenizer_ref.json, so that sampling and
evaluation load the tokenizer it trained with and notice if the file changed since.
"""

import hashlib
import json
import os
from collections.abc import Iterable

import numpy as np
import sentencepiece
import tokenizers

from jaxtrain.data.text import ByteTokenizer

BPE_FILE, REF_FILE = "tokenizer.json", "tokenizer_ref.json"
BPE_SPECIALS = ("<bos>", "<eos>", "<pad>")
# (BOS, EOS) names in the order they are looked for; GPT-2 and Qwen use one token for both.
BOS_EOS_NAMES = (("<bos>", "<eos>"), ("<s>", "</s>"), ("<|begin_of_text|>", "<|end_of_text|>"),
                 ("<|startoftext|>", "<|endoftext|>"), ("<|endoftext|>", "<|endoftext|>"))


def _fingerprint(kind: str, path: str | None = None) -> str:
  h = hashlib.sha256(kind.encode())
  if path is not None:
    with open(path, "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def _check_file(path: str, what: str) -> str:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} {path!r} does not exist")
  return os.path.abspath(path)


class Bytes(ByteTokenizer):
  """UTF-8 bytes as ids 0..255, BOS 256, EOS 257 (the ids of data.text.ByteTokenizer)."""

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def spec(self) -> dict:
    return {"kind": "byte"}

  def fingerprint(self) -> str:
    return _fingerprint("byte")


class HfTokenizer:
  """A `tokenizers` tokenizer.json; special-token names in the text are encoded as plain text."""

  def __init__(self, path: str):
    self.path = _check_file(path, "tokenizer file")
    self._tok = tokenizers.Tokenizer.from_file(self.path)
    self._tok.no_padding()
    self._tok.no_truncation()
    self._tok.encode_special_tokens = True  # "<eos>" in a document is text, not an EOS id
    self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    for bos, eos in BOS_EOS_NAMES:
      self.bos, self.eos = self._tok.token_to_id(bos), self._tok.token_to_id(eos)
      if self.bos is not None and self.eos is not None:
        break
    else:
      names = ", ".join(f"{b} {e}" for b, e in BOS_EOS_NAMES)
      raise ValueError(f"tokenizer {self.path!r} has no BOS/EOS tokens (looked for {names})")
    specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    self._specials = np.array(sorted(specials | {self.bos, self.eos}), np.int64)

  def encode(self, text: str) -> np.ndarray:
    return np.array(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    return [np.array(e.ids, np.int32) for e in encodings]

  def decode(self, ids) -> str:
    ids = np.asarray(ids, np.int64).ravel()
    ids = ids[(ids >= 0) & (ids < self.vocab_size) & ~np.isin(ids, self._specials)]
    return self._tok.decode(ids.tolist(), skip_special_tokens=True)

  def __reduce__(self):  # rebuilt from the file: a pickled Tokenizer forgets encode_special_tokens
    return HfTokenizer, (self.path,)

  def spec(self) -> dict:
    return {"kind": "hf", "path": self.path}

  def fingerprint(self) -> str:
    return _fingerprint("hf", self.path)


class SentencePieceTokenizer:
  """A SentencePiece .model; BOS/EOS are its bos_id/eos_id."""

  def __init__(self, path: str):
    self.path = _check_file(path, "tokenizer file")
    self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
    self.bos, self.eos = self._sp.bos_id(), self._sp.eos_id()
    self.vocab_size = self._sp.get_piece_size()
    if self.bos < 0 or self.eos < 0:
      raise ValueError(f"SentencePiece model {self.path!r} has no BOS/EOS (bos_id={self.bos}, "
                       f"eos_id={self.eos})")

  def encode(self, text: str) -> np.ndarray:
    return np.array(self._sp.encode(text, out_type=int), np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.array(ids, np.int32) for ids in self._sp.encode(list(texts), out_type=int)]

  def decode(self, ids) -> str:
    """Control ids (BOS, EOS, pad) decode to nothing in SentencePiece itself."""
    ids = np.asarray(ids, np.int64).ravel()
    return self._sp.decode(ids[(ids >= 0) & (ids < self.vocab_size)].tolist())

  def __reduce__(self):
    return SentencePieceTokenizer, (self.path,)

  def spec(self) -> dict:
    return {"kind": "sentencepiece", "path": self.path}

  def fingerprint(self) -> str:
    return _fingerprint("sentencepiece", self.path)


LOADERS = {"byte": lambda spec: Bytes(), "hf": lambda spec: HfTokenizer(spec["path"]),
           "sentencepiece": lambda spec: SentencePieceTokenizer(spec["path"])}


def load_tokenizer(spec: dict):
  """The tokenizer that spec() returned."""
  if spec.get("kind") not in LOADERS:
    raise ValueError(
        f"tokenizer spec: unknown kind {spec.get('kind')!r}; choose one of {', '.join(LOADERS)}")
  return LOADERS[spec["kind"]](spec)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str) -> HfTokenizer:
  """Trains a byte-level BPE (GPT-2's pre-tokenizer, all 256 bytes in the alphabet, ids 0..2 for
  <bos> <eos> <pad>) on streamed texts and saves it to `path`. The same texts give the same file."""
  floor = len(BPE_SPECIALS) + 256
  if vocab_size < floor:
    raise ValueError(f"bpe vocab_size={vocab_size} is below {floor} (3 special tokens + 256 bytes)")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, show_progress=False, special_tokens=list(BPE_SPECIALS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  tok.save(tmp)
  os.replace(tmp, path)  # a reader never sees half a file
  return HfTokenizer(path)


def make_tokenizer(data_cfg, workdir: str, texts: Iterable[str] | None = None):
  """The tokenizer data_cfg.tokenizer names: "byte", "bpe" (WORKDIR/tokenizer.json, trained on
  `texts` if absent) or the path of a tokenizer.json or SentencePiece .model."""
  name = data_cfg.tokenizer
  if name == "byte":
    return Bytes()
  if name == "bpe":
    path = os.path.join(workdir, BPE_FILE)
    if os.path.isfile(path):
      tok = HfTokenizer(path)
      if tok.vocab_size > data_cfg.bpe_vocab_size:
        raise ValueError(f"{path} has {tok.vocab_size} tokens, more than data.bpe_vocab_size="
                         f"{data_cfg.bpe_vocab_size}; delete it to retrain")
      return tok
    if texts is None:
      raise ValueError(
          f"data.tokenizer='bpe': {path} does not exist and no texts were given to train it on")
    return train_bpe(texts, data_cfg.bpe_vocab_size, path)
  if not os.path.isfile(name):
    raise FileNotFoundError(f"data.tokenizer {name!r} does not exist (expected 'byte', 'bpe', or a "
                            f"tokenizer.json / .model path)")
  return from_file(name)


def from_file(path: str):
  """The tokenizer of a tokenizer.json (.json) or SentencePiece (.model) file."""
  if path.endswith(".model"):
    return SentencePieceTokenizer(path)
  if path.endswith(".json"):
    return HfTokenizer(path)
  raise ValueError(f"data.tokenizer {path!r}: expected a tokenizer.json (.json) or a SentencePiece "
                   f"(.model) file")


def save_reference(tokenizer, workdir: str) -> None:
  """Writes WORKDIR/tokenizer_ref.json; a file inside the workdir is named relative to it, so the
  run directory can move."""
  spec = dict(tokenizer.spec())
  if "path" in spec:
    rel = os.path.relpath(spec["path"], os.path.abspath(workdir))
    if not rel.startswith(os.pardir):
      spec["path"] = rel
  os.makedirs(workdir, exist_ok=True)
  ref = {"spec": spec, "fingerprint": tokenizer.fingerprint()}
  path = os.path.join(workdir, REF_FILE)
  with open(path + ".tmp", "w") as f:  # replaced atomically: a kill never leaves half a file
    json.dump(ref, f, indent=2)
  os.replace(path + ".tmp", path)


def load_reference(workdir: str):
  """The tokenizer a run recorded with save_reference; ValueError if its file changed since."""
  ref_path = _check_file(os.path.join(workdir, REF_FILE), "tokenizer reference")
  with open(ref_path) as f:
    ref = json.load(f)
  spec = dict(ref["spec"])
  if "path" in spec:
    spec["path"] = os.path.join(os.path.abspath(workdir), spec["path"])  # no-op if absolute
  tok = load_tokenizer(spec)
  if tok.fingerprint() != ref["fingerprint"]:
    raise ValueError(
        f"tokenizer {spec.get('path', spec['kind'])!r} changed since the run recorded it "
        f"(fingerprint {tok.fingerprint()} != {ref['fingerprint']})")
  return tok
