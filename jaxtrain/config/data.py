"""The `data` section: what a language-model run reads, its defaults and checks. No jax import
here."""

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice, check_floats

DATA_KINDS = ("synthetic", "bytes", "text")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "arrayrecord", "hf")
PACKINGS = ("first_fit", "best_fit")
BAD_UTF8 = ("repair", "skip")
RANGES = {"data.eval_fraction": (0.0, 1.0, True)}


def data_defaults() -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.kind = "synthetic"  # one of DATA_KINDS
  d.path = ""  # bytes: a file, directory or glob of text files
  d.symbols = 200  # synthetic: alphabet of the random half
  d.stop_prob = 1 / 16  # synthetic: chance that the random half ends after each symbol
  d.max_symbols = 48  # synthetic: the random half never exceeds this
  d.eval_fraction = 0.05  # bytes, text: share of documents held out
  # text: a prepared corpus through the grain pipeline (jaxtrain/data/pipeline.py)
  d.format = "auto"  # one of DATA_FORMATS; auto picks by file extension
  d.text_field = "text"  # jsonl, parquet, hf: the field or column holding the text
  # "byte", "bpe" (trained on the corpus by prepare), or a tokenizer.json / .model path
  d.tokenizer = "byte"
  d.bpe_vocab_size = 1024  # bpe: vocabulary size to train (model.vocab_size must be at least this)
  d.add_bos = True
  d.add_eos = True
  d.cache_dir = ""  # "" = WORKDIR/data_cache
  d.packing = "first_fit"  # one of PACKINGS
  d.bad_utf8 = "repair"  # one of BAD_UTF8: replace invalid bytes with U+FFFD, or skip the document
  d.prepare_workers = 0  # 0 = one per core
  d.prefetch = 2  # batches prepared ahead by a background thread
  return d


def validate_data(cfg) -> None:
  d, m = cfg.data, cfg.model
  check_choice("data.kind", d.kind, DATA_KINDS)
  check_choice("data.format", d.format, DATA_FORMATS)
  check_choice("data.packing", d.packing, PACKINGS)
  check_choice("data.bad_utf8", d.bad_utf8, BAD_UTF8)
  if d.kind == "synthetic" and d.symbols + 4 > m.vocab_size:
    raise ConfigError(f"data.symbols={d.symbols} needs model.vocab_size >= {d.symbols + 4}")
  if d.kind == "synthetic" and not 0 < d.stop_prob < 1:
    raise ConfigError(f"data.stop_prob must be in (0, 1), got {d.stop_prob}")
  if d.kind == "synthetic" and not 1 <= d.max_symbols <= d.symbols:
    raise ConfigError(f"data.max_symbols must be in [1, data.symbols], got {d.max_symbols}")
  if d.kind == "bytes" and m.vocab_size < 258:
    raise ConfigError(f"data.kind='bytes' needs model.vocab_size >= 258, got {m.vocab_size}")
  if d.kind in ("bytes", "text") and not d.path and cfg.train.task == "lm":
    raise ConfigError(f"data.path is empty; data.kind={d.kind!r} needs a file, directory or glob")
  if d.kind == "text" and d.tokenizer == "byte" and m.vocab_size < 258:
    raise ConfigError(f"data.tokenizer='byte' needs model.vocab_size >= 258, got {m.vocab_size}")
  if d.kind == "text" and d.tokenizer == "bpe" and m.vocab_size < d.bpe_vocab_size:
    raise ConfigError(f"model.vocab_size={m.vocab_size} is below data.bpe_vocab_size="
                      f"{d.bpe_vocab_size}")
  check_floats("data", d, RANGES)
