"""Corpus sources: mixtures, file listing, format detection, planning into pieces, reading. No jax.

data.path is one source or a comma-separated mixture, each entry `SPEC[@WEIGHT]`; a SPEC is a file,
a directory (recursive, hidden entries skipped), a glob, or a Hugging Face dataset saved with
`save_to_disk`. Directories and `**` follow symlinks into each real directory once (loops end),
and a file reached under two names (links) is read once (filetree.py). Formats, by data.format or
(auto) by extension:
  text         each file is one document (.txt, .py, ... and any unknown extension)
  jsonl        each line is a JSON object; data.text_field holds the document (.jsonl, .json,
               .ndjson)
  (text and jsonl files may be compressed, a.txt.gz or a.jsonl.zst, and UTF-16/32 by their BOM:
  decoding.py)
  parquet      each row; data.text_field names a string or binary column (.parquet)
  arrayrecord  each record: UTF-8 text, or JSON with data.text_field when the file's first record is
               such an object (.arrayrecord, .array_record)
  hf           each row of a saved dataset (auto: a directory with dataset_info.json, state.json or
               dataset_dict.json; a DatasetDict contributes its "train" split or its only split)
A piece is a slice of one file that a worker reads on its own; readers yield (raw bytes, index,
skip reason) per document, and iter_texts turns them into clean text by the rules of report.py.
"""

import codecs
import functools
import json
import math
import os
import stat
from typing import NamedTuple

from jaxtrain.data import decoding, filetree, report

EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
              ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord"}
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataError(ValueError):
  """A corpus that cannot be used (missing, unreadable, no usable text); the message is one line."""


class Piece(NamedTuple):
  """Documents start..stop of one file: bytes (jsonl), row groups (parquet), records, or rows (hf).

  `first` numbers the piece's first document (a 1-based line for jsonl, a 0-based row otherwise)."""
  fmt: str
  path: str
  start: int
  stop: int
  first: int
  size: int


def parse_mixture(path: str) -> list[tuple[str, float]]:
  """"a/*.txt@0.7,b.jsonl@0.3" -> [("a/*.txt", 0.7), ("b.jsonl", 0.3)]; weights default to 1 and
  are normalized to sum to 1. Paths must not contain commas."""
  if not path.strip():
    raise DataError("data.path is empty; name a file, directory, glob or saved dataset")
  entries = []
  for entry in (e.strip() for e in path.split(",")):
    spec, weight = entry, 1.0
    if "@" in entry and not os.path.exists(entry):
      spec, text = entry.rsplit("@", 1)
      try:
        weight = float(text)
      except ValueError:
        raise DataError(f"data.path entry {entry!r}: weight {text!r} is not a number") from None
    if not spec or not math.isfinite(weight) or weight <= 0:
      raise DataError(f"data.path entry {entry!r}: need a path and a positive weight (SPEC@WEIGHT)")
    entries.append((spec, weight))
  total = sum(w for _, w in entries)
  return [(spec, w / total) for spec, w in entries]


def is_hf_dataset(path: str) -> bool:
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in HF_MARKERS)


def format_of(path: str, fmt: str) -> str:
  """The format of one file: data.format, or (auto) by extension (a.jsonl.gz is jsonl),
  text when unknown."""
  if fmt == "auto":
    fmt = EXTENSIONS.get(os.path.splitext(decoding.without_compression(path))[1].lower(), "text")
  if decoding.compression(path) and fmt not in ("text", "jsonl"):
    raise DataError(f"{path}: a compressed {fmt} file cannot be read; decompress it")
  return fmt


def _check_readable(path: str) -> None:
  """DataError unless path is a regular file that opens (a broken link, fifo or socket is not)."""
  try:
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
      raise DataError(f"cannot read {path}: not a regular file")
    with open(path, "rb"):
      pass
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def list_files(spec: str, fmt: str) -> list[tuple[str, str]]:
  """Sorted (path, format) pairs of a source; a saved HF dataset is one pair
  (its directory, "hf")."""
  if fmt == "hf" or (fmt == "auto" and is_hf_dataset(spec)):
    if not is_hf_dataset(spec):
      raise DataError(
          f"data.path {spec!r} is not a saved Hugging Face dataset (no {', '.join(HF_MARKERS)})")
    return [(spec, "hf")]
  if os.path.isdir(spec):
    files = filetree.walk(spec)
    if not files:
      raise DataError(f"data.path {spec!r} is a directory without files")
  elif os.path.lexists(spec):
    files = [spec]
  elif any(c in spec for c in filetree.GLOB_CHARS):
    files = filetree.glob(spec)
    if not files:
      raise DataError(f"data.path {spec!r} matches no files")
  else:
    raise DataError(f"data.path {spec!r} does not exist")
  files = filetree.once(files)
  for f in files:
    _check_readable(f)
  return [(f, format_of(f, fmt)) for f in files]


def _split(fmt, path, count, size, piece_bytes, first=0):
  """Pieces of `count` equal-sized documents of one file, each about piece_bytes."""
  per = max(1, min(count, int(piece_bytes * count // max(size, 1))))
  return [Piece(fmt, path, s, min(s + per, count), first + s,
                size * (min(s + per, count) - s) // count) for s in range(0, count, per)]


def _plan_text(path, text_field, piece_bytes):
  return [Piece("text", path, 0, 0, 0, os.path.getsize(path))]


def _plan_jsonl(path, text_field, piece_bytes):
  """Byte ranges that start on a line, each at least piece_bytes (the last may be shorter); a
  compressed or UTF-16/32 file is one piece, "jsonl_stream", read whole."""
  pieces, start, offset, line = [], 0, 0, 1
  with open(path, "rb") as f:
    if decoding.compression(path) or decoding.needs_decoding(f.read(4)):
      return [Piece("jsonl_stream", path, 0, os.path.getsize(path), 1, os.path.getsize(path))]
    f.seek(0)
    for k, raw in enumerate(f, 1):
      offset += len(raw)
      if offset - start >= piece_bytes:
        pieces.append(Piece("jsonl", path, start, offset, line, offset - start))
        start, line = offset, k + 1
  if offset > start:
    pieces.append(Piece("jsonl", path, start, offset, line, offset - start))
  return pieces


def _plan_parquet(path, text_field, piece_bytes):
  import pyarrow as pa
  import pyarrow.parquet as pq
  try:
    meta = pq.ParquetFile(path).metadata
  except (pa.ArrowException, OSError) as e:
    raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
  schema = meta.schema.to_arrow_schema()
  if text_field not in schema.names:
    raise DataError(f"{path} has no column {text_field!r} (data.text_field); "
                    f"columns: {', '.join(schema.names)}")
  kind = schema.field(text_field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
          or pa.types.is_large_binary(kind)):
    raise DataError(f"{path}: column {text_field!r} has type {kind}, not string or binary")
  pieces, start, row, rows, size = [], 0, 0, 0, 0
  for g in range(meta.num_row_groups if meta.num_rows else 0):
    rows += meta.row_group(g).num_rows
    size += meta.row_group(g).total_byte_size
    if size >= piece_bytes or g == meta.num_row_groups - 1:
      pieces.append(Piece("parquet", path, start, g + 1, row, size))
      start, row, rows, size = g + 1, row + rows, 0, 0
  return pieces


@functools.lru_cache(maxsize=8)
def _array_record(path):
  from grain.sources import ArrayRecordDataSource  # grain imports jax: only when needed
  try:
    return ArrayRecordDataSource([path])
  except RuntimeError as e:
    raise DataError(f"{path}: not a readable ArrayRecord file ({str(e).splitlines()[0]})") from None


def _is_json_record(record: bytes, text_field: str) -> bool:
  if not record.lstrip().startswith(b"{"):
    return False
  try:
    obj = json.loads(record.decode("utf-8", "surrogateescape"), strict=False)
  except ValueError:
    return False
  return isinstance(obj, dict) and text_field in obj


def _plan_arrayrecord(path, text_field, piece_bytes):
  source = _array_record(path)
  if not len(source):
    return []
  fmt = "arrayrecord_json" if _is_json_record(source[0], text_field) else "arrayrecord"
  return _split(fmt, path, len(source), os.path.getsize(path), piece_bytes)


@functools.lru_cache(maxsize=8)
def _hf_dataset(path):
  import datasets
  try:
    return datasets.load_from_disk(path)
  except (FileNotFoundError, ValueError) as e:
    raise DataError(
        f"{path}: not a saved Hugging Face dataset ({str(e).splitlines()[0]})") from None


def _plan_hf(path, text_field, piece_bytes):
  ds = _hf_dataset(path)
  if hasattr(ds, "keys"):  # a DatasetDict
    splits = sorted(ds.keys())
    if "train" not in splits and len(splits) != 1:
      raise DataError(
          f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(splits)})")
    path = os.path.join(path, "train" if "train" in splits else splits[0])
    ds = _hf_dataset(path)
  if text_field not in ds.column_names:
    raise DataError(f"{path} has no column {text_field!r} (data.text_field); columns: "
                    f"{', '.join(ds.column_names)}")
  return _split("hf", path, len(ds), ds.data.nbytes, piece_bytes) if len(ds) else []


PLANNERS = {"text": _plan_text, "jsonl": _plan_jsonl, "parquet": _plan_parquet,
            "arrayrecord": _plan_arrayrecord, "hf": _plan_hf}


def plan_pieces(files: list[tuple[str, str]], text_field: str, piece_bytes: int,
                counts: dict) -> list[Piece]:
  """Every file's pieces in order; files that hold no documents count as empty_files."""
  pieces = []
  for path, fmt in files:
    found = [] if fmt != "hf" and os.path.getsize(path) == 0 else PLANNERS[fmt](path, text_field,
                                                                                piece_bytes)
    if not found:
      report.note(counts, "empty_files", path)
    pieces += found
  return pieces


def _to_bytes(text: str) -> bytes:
  """UTF-8 of a str; lone surrogates (bad bytes kept by surrogateescape, or \\ud800 escapes in JSON)
  become invalid UTF-8 that the bad_utf8 rule then handles like invalid bytes in a text file."""
  try:
    return text.encode("utf-8")
  except UnicodeEncodeError:
    try:
      return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
      return text.encode("utf-8", "surrogatepass")


def _from_value(value):
  """(raw, None) for a str/bytes field value, (None, "missing_field") otherwise."""
  if isinstance(value, str):
    return _to_bytes(value), None
  if isinstance(value, bytes):
    return value, None
  return None, "missing_field"


def _from_json(line: bytes, text_field: str):
  """(raw text bytes, None), or (None, skip reason) for a malformed line or a missing text field."""
  try:
    obj = json.loads(line.decode("utf-8", "surrogateescape"), strict=False)
  except ValueError:
    return None, "malformed_json"
  return _from_value(obj.get(text_field)) if isinstance(obj, dict) else (None, "missing_field")


def _read(path: str, start: int = 0, size: int = -1) -> bytes:
  try:
    with open(path, "rb") as f:
      f.seek(start)
      return f.read(size)
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _converted(counts: dict, case: str, path: str) -> None:
  report.note(counts, case, path, "converted")


def _read_text(piece, text_field, counts):
  """The file is the document; a compressed one that does not decompress whole is skipped."""
  kind = decoding.compression(piece.path)
  if kind is None:
    yield _read(piece.path), piece.first, None
    return
  try:
    raw = b"".join(decoding.file_chunks(piece.path))
  except decoding.CorruptFile:
    yield None, piece.first, "corrupt_compressed"
    return
  _converted(counts, f"decompressed_{kind}", piece.path)
  yield raw, piece.first, None


def _jsonl_line(line: bytes, text_field: str):
  line = line[:-1] if line.endswith(b"\r") else line
  return _from_json(line, text_field) if line.strip() else (b"", None)


def _read_jsonl(piece, text_field, counts):
  data = _read(piece.path, piece.start, piece.stop - piece.start)
  if piece.start == 0 and data.startswith(codecs.BOM_UTF8):
    data = data[len(codecs.BOM_UTF8):]
    _converted(counts, "removed_utf8_bom", piece.path)
  lines = data.split(b"\n")
  if not lines[-1]:
    lines.pop()  # the text after the final newline is not a line
  for k, line in enumerate(lines):
    raw, reason = _jsonl_line(line, text_field)
    yield raw, piece.first + k, reason


def _lines(chunks):
  """The lines of a stream of chunks (without the newline);
  the text after the final newline is one."""
  parts = []
  for chunk in chunks:
    first, *lines = chunk.split(b"\n")
    parts.append(first)
    if lines:
      yield b"".join(parts)
      yield from lines[:-1]
      parts = [lines[-1]]
  if tail := b"".join(parts):
    yield tail


def _read_jsonl_stream(piece, text_field, counts):
  """A compressed or UTF-16/32 file, line by line;
  the lines that decompressed before damage are kept."""
  index = piece.first
  try:
    for line in _lines(decoding.utf8_chunks(decoding.file_chunks(piece.path),
                                            lambda case: _converted(counts, case, piece.path))):
      raw, reason = _jsonl_line(line, text_field)
      yield raw, index, reason
      index += 1
  except decoding.CorruptFile:
    yield None, index, "corrupt_compressed"
    return
  except OSError as e:
    raise DataError(f"cannot read {piece.path}: {e.strerror or e}") from None
  if kind := decoding.compression(piece.path):
    _converted(counts, f"decompressed_{kind}", piece.path)


def _cells(values, first):
  for k, value in enumerate(values):
    raw, reason = _from_value(value)
    yield raw, first + k, reason


def _read_parquet(piece, text_field, counts):
  import pyarrow.parquet as pq
  table = pq.ParquetFile(piece.path).read_row_groups(range(piece.start, piece.stop),
                                                     columns=[text_field])
  return _cells(table.column(0).to_pylist(), piece.first)


def _read_arrayrecord(piece, text_field, counts):
  records = _array_record(piece.path).__getitems__(range(piece.start, piece.stop))
  for k, record in enumerate(records):
    raw, reason = (_from_json(record, text_field) if piece.fmt == "arrayrecord_json"
                   else (record, None))
    yield raw, piece.first + k, reason


def _read_hf(piece, text_field, counts):
  rows = _hf_dataset(piece.path).select_columns([text_field])[piece.start:piece.stop]
  return _cells(rows[text_field], piece.first)


READERS = {"text": _read_text, "jsonl": _read_jsonl, "jsonl_stream": _read_jsonl_stream,
           "parquet": _read_parquet, "arrayrecord": _read_arrayrecord,
           "arrayrecord_json": _read_arrayrecord, "hf": _read_hf}


def location(piece: Piece, index: int) -> str:
  """Where a document is, for the report: the file, file:LINE (jsonl) or file[ROW]."""
  if piece.fmt == "text":
    return piece.path
  return f"{piece.path}:{index}" if piece.fmt.startswith("jsonl") else f"{piece.path}[{index}]"


def iter_texts(pieces, text_field: str, bad_utf8: str, counts: dict):
  """The clean text of every usable document of the pieces, in order; counts every case."""
  for piece in pieces:
    for raw, index, reason in READERS[piece.fmt](piece, text_field, counts):
      text = report.clean(raw, reason, bad_utf8, counts, lambda: location(piece, index))
      if text is not None:
        yield text
