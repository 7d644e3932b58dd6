"""Compressed files and byte-order marks, undone before the rules of report.py apply. Stdlib and
pyarrow.

A file named *.gz (gzip) or *.zst (zstd) is decompressed as it is read; its format is that of its
name without the suffix (a.jsonl.gz is jsonl). Bytes that start with a UTF-32 or UTF-16 byte-order
mark (LE or BE) are decoded to UTF-8 and a UTF-8 mark is dropped; each sequence the codec cannot
decode becomes one invalid UTF-8 byte, which data.bad_utf8 then repairs or skips as in any UTF-8
file. zstd is read with pyarrow's codec (pyarrow is a dependency already; the zstandard package is
not).
"""

import codecs
import gzip
import itertools
import os
import zlib

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
CONVERTED = ("decompressed_gzip", "decompressed_zstd", "decoded_utf16", "decoded_utf32",
             "removed_utf8_bom")
# (mark, codec, case); UTF-32 first, as its LE mark starts with UTF-16's.
MARKS = ((codecs.BOM_UTF32_LE, "utf-32-le",
          "decoded_utf32"), (codecs.BOM_UTF32_BE, "utf-32-be",
                             "decoded_utf32"), (codecs.BOM_UTF16_LE, "utf-16-le", "decoded_utf16"),
         (codecs.BOM_UTF16_BE, "utf-16-be", "decoded_utf16"), (codecs.BOM_UTF8, "utf-8",
                                                               "removed_utf8_bom"))
# bytes read at a time; a corrupt stream keeps what the reads before the damage returned
CHUNK = 1 << 20
_BAD = "jaxtrain.invalid_utf8"
# encoded with surrogateescape: the byte 0xFF
codecs.register_error(_BAD, lambda e: ("\udcff", e.end))


class CorruptFile(Exception):
  """A compressed file that does not decompress to its end."""


def compression(path: str) -> str | None:
  """"gzip" or "zstd" by the file's name, None for a plain file."""
  return COMPRESSIONS.get(os.path.splitext(path)[1].lower())


def without_compression(path: str) -> str:
  """"a.jsonl.gz" -> "a.jsonl"; a plain name unchanged."""
  return os.path.splitext(path)[0] if compression(path) else path


def mark(head: bytes):
  """(mark, codec, case) of the byte-order mark that head starts with, or None."""
  return next((m for m in MARKS if head.startswith(m[0])), None)


def needs_decoding(head: bytes) -> bool:
  """Whether bytes starting with head are UTF-16 or UTF-32 by their mark
  (not line-splittable as bytes)."""
  found = mark(head)
  return found is not None and found[1] != "utf-8"


def transcode(raw: bytes) -> tuple[bytes, str | None]:
  """(UTF-8 bytes, case) of bytes that start with a byte-order mark; (raw, None) without one."""
  found = mark(raw[:4])
  if found is None:
    return raw, None
  bom, codec, case = found
  body = raw[len(bom):]
  return (body if codec == "utf-8" else body.decode(codec, _BAD).encode("utf-8",
                                                                        "surrogateescape")), case


def _open(path: str, kind: str):
  if kind == "gzip":
    return gzip.open(path, "rb")
  import pyarrow as pa
  return pa.CompressedInputStream(pa.OSFile(path), "zstd")


def file_chunks(path: str):
  """A file's bytes, decompressed, CHUNK at a time;
  CorruptFile where a compressed file stops early."""
  kind = compression(path)
  try:
    with open(path, "rb") if kind is None else _open(path, kind) as f:
      while chunk := f.read(CHUNK):
        yield chunk
  # pyarrow's errors are OSError or ValueError
  except (OSError, EOFError, ValueError, zlib.error) as e:
    if kind is None:
      raise
    raise CorruptFile(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def utf8_chunks(chunks, on_mark):
  """chunks decoded to UTF-8 by the byte-order mark of their first bytes
  (on_mark(case) when found)."""
  chunks, head = iter(chunks), b""
  for chunk in chunks:
    head += chunk
    if len(head) >= 4:
      break
  found = mark(head)
  if found is not None:
    on_mark(found[2])
  if found is None or found[1] == "utf-8":
    yield head[len(found[0]):] if found else head
    yield from chunks
    return
  decoder = codecs.getincrementaldecoder(found[1])(_BAD)
  for chunk in itertools.chain([head[len(found[0]):]], chunks):
    yield decoder.decode(chunk).encode("utf-8", "surrogateescape")
  yield decoder.decode(b"", final=True).encode("utf-8", "surrogateescape")
