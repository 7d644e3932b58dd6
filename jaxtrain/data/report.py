"""Bad-input rules and the data report that counts every case. Stdlib only (and decoding.py).

Every document read is counted once: kept, or skipped for the first reason that applies:
  malformed_json  a jsonl line or JSON record that does not parse (examples give file:LINE)
  missing_field   JSON that is not an object or lacks a string data.text_field; a null cell
  empty           no bytes or only whitespace (also once NUL bytes are removed)
  binary          over 30% of its bytes are control bytes (0x00-0x08, 0x0E-0x1F, 0x7F) or invalid
                  UTF-8 sequences: executables, images, archives, UTF-16 without a BOM, NUL-heavy
                  files
  invalid_utf8    invalid UTF-8 when data.bad_utf8 is "skip"
  corrupt_compressed  a .gz/.zst text file that does not decompress whole; in a jsonl file the line
                  where the damage begins (file:LINE; the lines decompressed before it are kept)
Converted, and counted, before these rules (decoding.py): decompressed_gzip and decompressed_zstd
count files that decompressed whole; decoded_utf16, decoded_utf32 and removed_utf8_bom count
documents (text files, records, cells) and jsonl files that start with that byte-order mark.
Kept documents are repaired and counted: invalid UTF-8 (data.bad_utf8 "repair") becomes U+FFFD, one
per bad sequence as Python's "replace" does; NUL bytes are removed. A file that holds no document
(0 bytes, or a table without rows) counts as an empty file. long_documents counts kept documents of
more than seq_len tokens (BOS/EOS included), which the pipeline splits; none is dropped.
"""

from jaxtrain.data import decoding

SKIPPED = ("malformed_json", "missing_field", "empty", "binary", "invalid_utf8",
           "corrupt_compressed")
REPAIRED = ("invalid_utf8", "nul")
EXAMPLES = 5  # locations kept per case
BINARY_FRACTION = 0.3
_CONTROL = bytes([*range(0, 9), *range(14, 32), 127])
_REPLACEMENT = "\ufffd".encode()


def new_counts() -> dict:
  return {"files": 0, "empty_files": 0, "input_bytes": 0, "documents": 0, "kept": 0, "tokens": 0,
          "skipped": dict.fromkeys(SKIPPED, 0), "repaired": dict.fromkeys(REPAIRED, 0),
          "converted": dict.fromkeys(decoding.CONVERTED, 0),
          "nul_bytes_removed": 0, "examples": {}}


def note(counts: dict, case: str, where, group: str | None = None) -> None:
  """Counts one case (a key of counts, or of counts[group]); keeps the first EXAMPLES locations.

  `where` is a location string or a function returning one (only called when kept)."""
  (counts[group] if group else counts)[case] += 1
  found = counts["examples"].setdefault(case, [])
  if len(found) < EXAMPLES:
    found.append(where() if callable(where) else where)


def _decode(raw: bytes) -> tuple[str, int]:
  """(text with U+FFFD for each invalid sequence, number of invalid sequences)."""
  try:
    return raw.decode("utf-8"), 0
  except UnicodeDecodeError:
    text = raw.decode("utf-8", "replace")
    return text, text.count("\ufffd") - raw.count(_REPLACEMENT)


def _blank(s) -> bool:
  return not s or s.isspace()


def clean(raw: bytes | None, reason: str | None, bad_utf8: str, counts: dict, where) -> str | None:
  """The document's text by the rules above, or None when skipped; counts the case either way.

  `reason` is a skip reason the reader already found (malformed_json, missing_field), else None."""
  counts["documents"] += 1
  bad = nul = 0
  if reason is None:
    raw, case = decoding.transcode(raw)
    if case:
      note(counts, case, where, "converted")
  if reason is None and _blank(raw):
    reason = "empty"
  if reason is None:
    text, bad = _decode(raw)
    control = len(raw) - len(raw.translate(None, _CONTROL))
    if bad + control > BINARY_FRACTION * len(raw):
      reason = "binary"
    elif bad and bad_utf8 == "skip":
      reason = "invalid_utf8"
  if reason is None:
    nul = raw.count(0)
    text = text.replace("\x00", "") if nul else text
    reason = "empty" if _blank(text) else None
  if reason is not None:
    note(counts, reason, where, "skipped")
    return None
  if bad:
    note(counts, "invalid_utf8", where, "repaired")
  if nul:
    note(counts, "nul", where, "repaired")
    counts["nul_bytes_removed"] += nul
  counts["kept"] += 1
  return text


def merge(total: dict, part: dict) -> dict:
  """Adds part's counts into total (max for max_* keys; examples up to EXAMPLES); returns total."""
  for key, value in part.items():
    if key == "examples":
      for case, found in value.items():
        have = total.setdefault("examples", {}).setdefault(case, [])
        have += found[:EXAMPLES - len(have)]
    elif isinstance(value, dict):
      merge(total.setdefault(key, {}), value)
    elif isinstance(value, int) and not isinstance(value, bool):
      total[key] = max(total.get(key, 0),
                       value) if key.startswith("max_") else total.get(key, 0) + value
  return total


def _where(examples: list, n: int) -> str:
  """" (a, b, ...)": the first two example locations of n cases."""
  return f" ({', '.join(examples[:2])}{', ...' if n > 2 else ''})" if examples else ""


def _cases(counts: dict, group: str, examples: dict) -> str:
  parts = [f"{case} {n:,}{_where(examples.get(case, []), n)}" for case, n in counts.items() if n]
  return f"  {group} {sum(counts.values()):,}: " + "; ".join(parts) if parts else ""


def format_report(report: dict) -> str:
  """A few lines for the end of `prepare`: totals,
  then each non-zero case with example locations."""
  r, ex = report, report.get("examples", {})
  lines = [f"data: {len(r.get('sources', [r]))} source(s), {r['files']:,} file(s) "
           f"({r['empty_files']:,} empty), "
           f"{r['documents']:,} document(s): {r['kept']:,} kept, {r['tokens']:,} tokens"]
  if r["empty_files"]:
    lines.append(
        f"  empty files {r['empty_files']:,}{_where(ex.get('empty_files', []), r['empty_files'])}")
  lines += [_cases(r.get("converted", {}), "converted", ex), _cases(r["skipped"], "skipped", ex),
            _cases(r["repaired"], "repaired", ex)]
  if r["nul_bytes_removed"]:
    lines.append(f"  NUL bytes removed: {r['nul_bytes_removed']:,}")
  if r.get("seq_len"):
    lines.append(f"  long documents (> seq_len {r['seq_len']} tokens, split by the pipeline): "
                 f"{r['long_documents']:,}; longest {r['max_document_tokens']:,} tokens")
  if r.get("report_path"):
    lines.append(f"  report: {r['report_path']}")
  return "\n".join(line for line in lines if line)
