"""Host-side batches by config: a synthetic language, raw bytes of files, and real corpora (kind
"text").

kind "text": sources -> (prepare) tokenized cache -> grain pipeline (shuffle, pack, batch,
prefetch).
"""

from jaxtrain.data import pipeline, prepare as prepare_lib, tokenizers
from jaxtrain.data.synthetic import SymbolTokenizer, SyntheticLanguage
from jaxtrain.data.text import ByteCorpus, ByteTokenizer


def _synthetic(cfg, split):
  d, t = cfg.data, cfg.train
  return SyntheticLanguage(d.symbols, d.stop_prob, d.max_symbols, t.seq_len, t.seed, split)


def _bytes(cfg, split):
  d, t = cfg.data, cfg.train
  return ByteCorpus(d.path, t.seq_len, t.seed, split, d.eval_fraction, t.batch_size)


SOURCES = {"synthetic": _synthetic, "bytes": _bytes}


def make_source(cfg, split: str):
  """The batch source that cfg.data.kind names, for split "train" or "eval"."""
  if cfg.data.kind not in SOURCES:
    choices = ", ".join(SOURCES)
    raise ValueError(f"data.kind: unknown value {cfg.data.kind!r}; choose one of {choices}")
  return SOURCES[cfg.data.kind](cfg, split)


class IndexedIterator:
  """Rows lo..hi of consecutive global batches of a random-access source; the state is the index."""

  def __init__(self, source, lo: int, hi: int, index: int = 0):
    self.source, self.lo, self.hi, self.index = source, lo, hi, index

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = self.source.batch(self.index, self.lo, self.hi)
    self.index += 1
    return batch

  def get_state(self) -> dict:
    return {"index": self.index}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])


def make_iterator(cfg, split: str, lo: int, hi: int, workdir: str, process_index: int = 0,
                  process_count: int = 1):
  """This process's rows lo..hi of each global batch of `split`, with get_state/set_state.

  kind "text" reads the caches that `prepare_corpus` wrote (it must have run first)."""
  if cfg.data.kind != "text":
    return IndexedIterator(make_source(cfg, split), lo, hi)
  d, t = cfg.data, cfg.train
  if hi - lo != t.batch_size // process_count:
    raise ValueError(
        f"text data needs each process to hold a contiguous 1/{process_count} of the batch rows")
  layout = prepare_lib.cache_layout(cfg, workdir)
  return pipeline.TextPipeline([path for _, _, path in layout], [w for _, w, _ in layout],
                               t.seq_len, t.batch_size, t.seed, split, d.eval_fraction, d.packing,
                               process_index, process_count, d.prefetch)


def prepare_corpus(cfg, workdir: str, progress: bool = True) -> dict:
  """kind "text": the run's tokenizer (trained on the corpus for "bpe"), its reference in the
  workdir, and the token caches (reused when corpus, tokenizer and rules are unchanged); the
  report."""
  texts = prepare_lib.corpus_texts(cfg) if cfg.data.tokenizer == "bpe" else None
  tokenizer = tokenizers.make_tokenizer(cfg.data, workdir, texts=texts)
  tokenizers.save_reference(tokenizer, workdir)
  return prepare_lib.prepare(cfg, workdir, tokenizer, seq_len=cfg.train.seq_len, progress=progress)


def make_tokenizer(cfg, workdir: str):
  """The tokenizer that turns prompts into ids and samples back into text for the run in workdir."""
  makers = {"synthetic": lambda: SymbolTokenizer(cfg.data.symbols), "bytes": ByteTokenizer,
            "text": lambda: tokenizers.load_reference(workdir)}
  return makers[cfg.data.kind]()
