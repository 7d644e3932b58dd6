"""Corpus sources: mixture parsing, listing, every format read, the bad-input rules, one-line errors."""

import codecs
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtrain.data import decoding, report, sources
from jaxtrain.data.sources import DataError, Piece
from tests.fixtures import ROOT

TEXTS = ["first doc", "second\nline", "third é", "fourth"]


def read_all(spec, fmt="auto", text_field="text", bad_utf8="repair", piece_bytes=1 << 20):
  """(texts, counts, pieces) of a source, read the way prepare reads it."""
  counts = report.new_counts()
  pieces = sources.plan_pieces(sources.list_files(str(spec), fmt), text_field, piece_bytes, counts)
  texts = list(sources.iter_texts(pieces, text_field, bad_utf8, counts))
  return texts, counts, pieces


def assert_one_line_error(fn, *fragments):
  with pytest.raises(DataError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and all(f in msg for f in fragments), msg


def test_parse_mixture():
  got = sources.parse_mixture("a/*.txt@0.7, b.jsonl@0.3")
  assert [s for s, _ in got] == ["a/*.txt", "b.jsonl"]
  np.testing.assert_allclose([w for _, w in got], [0.7, 0.3])
  assert sources.parse_mixture("x") == [("x", 1.0)]
  np.testing.assert_allclose([w for _, w in sources.parse_mixture("a,b@3")], [0.25, 0.75])
  for bad, fragment in [("", "empty"), ("a@x", "not a number"), ("a@-1", "positive"), ("a,,b", "''"),
                        ("a@0", "positive"), ("@2", "positive"), ("a@inf", "positive")]:
    assert_one_line_error(lambda: sources.parse_mixture(bad), fragment)


def test_parse_mixture_keeps_an_existing_path_with_at(tmp_path):
  path = tmp_path / "v@2.txt"
  path.write_text("x")
  assert sources.parse_mixture(f"{path},{tmp_path}/b@2") == [(str(path), 1 / 3), (f"{tmp_path}/b", 2 / 3)]


def test_list_files_directory_glob_and_formats(tmp_path):
  for rel in ["b.txt", "a.jsonl", "sub/c.parquet", "sub/d.arrayrecord", "e.py", ".hidden", ".git/x", "f.JSON"]:
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text("x")
  got = [(os.path.relpath(p, tmp_path), f) for p, f in sources.list_files(str(tmp_path), "auto")]
  assert got == [("a.jsonl", "jsonl"), ("b.txt", "text"), ("e.py", "text"), ("f.JSON", "jsonl"),
                 ("sub/c.parquet", "parquet"), ("sub/d.arrayrecord", "arrayrecord")]
  assert [f for _, f in sources.list_files(str(tmp_path), "text")] == ["text"] * 6
  globbed = sources.list_files(str(tmp_path / "*.*"), "auto")
  assert [os.path.basename(p) for p, _ in globbed] == ["a.jsonl", "b.txt", "e.py", "f.JSON"]
  assert sources.list_files(str(tmp_path / "b.txt"), "auto") == [(str(tmp_path / "b.txt"), "text")]


def test_missing_and_unreadable_paths_are_one_line_errors(tmp_path):
  assert_one_line_error(lambda: sources.list_files(str(tmp_path / "nope.txt"), "auto"), "does not exist")
  assert_one_line_error(lambda: sources.list_files(str(tmp_path / "*.txt"), "auto"), "matches no files")
  (tmp_path / "empty_dir").mkdir()
  assert_one_line_error(lambda: sources.list_files(str(tmp_path / "empty_dir"), "auto"), "without files")
  assert_one_line_error(lambda: sources.list_files(str(tmp_path / "empty_dir"), "hf"), "not a saved")
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "ok.txt").write_text("fine")
  os.symlink(bad / "gone.txt", bad / "link.txt")
  assert_one_line_error(lambda: sources.list_files(str(bad), "auto"), "cannot read", "link.txt")
  os.remove(bad / "link.txt")
  os.mkfifo(bad / "pipe.txt")
  assert_one_line_error(lambda: sources.list_files(str(bad), "auto"), "cannot read", "pipe.txt",
                        "not a regular file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads chmod 000 files; fifo and broken-link cases stand in")
def test_permission_denied_is_one_line_error(tmp_path):
  (tmp_path / "secret.txt").write_text("x")
  os.chmod(tmp_path / "secret.txt", 0)
  assert_one_line_error(lambda: sources.list_files(str(tmp_path), "auto"), "cannot read", "Permission denied")


def clean(raw, bad_utf8="repair", reason=None):
  counts = report.new_counts()
  text = report.clean(raw, reason, bad_utf8, counts, "here")
  cases = {f"{g}.{k}": n for g in ("converted", "skipped", "repaired") for k, n in counts[g].items() if n}
  return text, cases, counts


def test_clean_rules():
  rng = np.random.default_rng(0)
  assert clean(b"plain text")[:2] == ("plain text", {})
  assert clean("keeps a real \ufffd".encode())[:2] == ("keeps a real \ufffd", {})
  assert clean(b"")[:2] == (None, {"skipped.empty": 1})
  assert clean(b" \n\t ")[:2] == (None, {"skipped.empty": 1})
  assert clean(b"caf\xe9 au lait")[:2] == ("caf\ufffd au lait", {"repaired.invalid_utf8": 1})
  assert clean(b"caf\xe9 au lait", "skip")[:2] == (None, {"skipped.invalid_utf8": 1})
  text, cases, counts = clean(b"ab\x00cdefgh\x00ijklm")
  assert (text, cases, counts["nul_bytes_removed"]) == ("abcdefghijklm", {"repaired.nul": 1}, 2)
  assert clean(b"\x00" * 20)[:2] == (None, {"skipped.binary": 1})
  assert clean(rng.bytes(4096))[:2] == (None, {"skipped.binary": 1})
  assert clean("a UTF-16 document".encode("utf-16-le"))[:2] == (None, {"skipped.binary": 1})  # no BOM
  assert clean("a UTF-16 document".encode("utf-16"))[:2] == ("a UTF-16 document", {"converted.decoded_utf16": 1})
  assert clean(codecs.BOM_UTF8 + b"\x00")[:2] == (None, {"converted.removed_utf8_bom": 1, "skipped.binary": 1})
  assert clean(b"\n\n\x00\n\n\n")[:2] == (None, {"skipped.empty": 1})  # 1 NUL in 6 bytes, then blank
  assert clean(b"{", reason="malformed_json")[:2] == (None, {"skipped.malformed_json": 1})
  _, _, counts = clean(b"x")
  assert (counts["documents"], counts["kept"], counts["examples"]) == (1, 1, {})


def test_examples_and_merge_keep_the_first_few():
  a, b = report.new_counts(), report.new_counts()
  for i in range(4):
    report.note(a, "binary", f"a{i}", "skipped")
    report.note(b, "binary", lambda i=i: f"b{i}", "skipped")
  b["max_document_tokens"] = 7
  total = report.merge(report.merge(report.new_counts(), a), b)
  assert total["skipped"]["binary"] == 8 and total["max_document_tokens"] == 7
  assert total["examples"]["binary"] == ["a0", "a1", "a2", "a3", "b0"]


def test_text_files(tmp_path):
  for i, t in enumerate(TEXTS):
    (tmp_path / f"{i}.txt").write_text(t)
  texts, counts, pieces = read_all(tmp_path)
  assert texts == TEXTS and len(pieces) == 4 and (counts["documents"], counts["kept"]) == (4, 4)


def write_jsonl(path, lines):
  path.write_bytes(b"".join(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n"
                            for line in lines))


@pytest.mark.parametrize("piece_bytes", [1, 40, 1 << 20])
def test_jsonl_lines_pieces_and_line_numbers(tmp_path, piece_bytes):
  lines = [{"text": TEXTS[0], "id": 1}, b"\r\n", b'{"text": "crlf"}\r\n', b"{broken\n", {"body": "x"},
           [1, 2], {"text": None}, {"text": TEXTS[1]}, {"text": "nul\u0000 via escape"}, b'{"text": "last"}']
  write_jsonl(tmp_path / "d.jsonl", lines)
  texts, counts, pieces = read_all(tmp_path / "d.jsonl", piece_bytes=piece_bytes)
  assert texts == [TEXTS[0], "crlf", TEXTS[1], "nul via escape", "last"]
  assert counts["skipped"] == {"malformed_json": 1, "missing_field": 3, "empty": 1, "binary": 0, "invalid_utf8": 0,
                               "corrupt_compressed": 0}
  p = str(tmp_path / "d.jsonl")
  assert counts["examples"]["malformed_json"] == [f"{p}:4"]
  assert counts["examples"]["missing_field"] == [f"{p}:5", f"{p}:6", f"{p}:7"]
  assert counts["examples"]["empty"] == [f"{p}:2"]
  # line sizes 31 2 18 8 14 7 15 25 33 16: pieces of >= 40 bytes start at lines 1, 4 (51 B), 8 (44 B), 10 (58 B)
  firsts = {1: list(range(1, 11)), 40: [1, 4, 8, 10], 1 << 20: [1]}[piece_bytes]
  assert [p.first for p in pieces] == firsts
  assert pieces[-1].stop == os.path.getsize(p) and all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))


def test_jsonl_invalid_utf8_inside_a_string_is_repaired_like_text(tmp_path):
  (tmp_path / "d.jsonl").write_bytes(b'{"text": "caf\xe9"}\n{"text": "lone \\ud800 surrogate"}\n')
  texts, counts, _ = read_all(tmp_path / "d.jsonl")
  assert texts == ["caf\ufffd", "lone \ufffd\ufffd\ufffd surrogate"]  # CESU bytes ED A0 80: 3 bad
  assert counts["repaired"]["invalid_utf8"] == 2
  texts, counts, _ = read_all(tmp_path / "d.jsonl", bad_utf8="skip")
  assert texts == [] and counts["skipped"]["invalid_utf8"] == 2


def test_parquet_row_groups_nulls_and_binary(tmp_path):
  table = pa.table({"text": TEXTS + [None, ""], "n": list(range(6))})
  pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
  pq.write_table(pa.table({"text": pa.array([b"raw \xff", b"ok"], pa.binary())}), tmp_path / "b.parquet")
  texts, counts, pieces = read_all(tmp_path, piece_bytes=1)
  assert texts == TEXTS + ["raw \ufffd", "ok"]
  assert [(p.start, p.stop, p.first) for p in pieces] == [(0, 1, 0), (1, 2, 2), (2, 3, 4), (0, 1, 0)]
  assert counts["skipped"]["missing_field"] == 1 and counts["skipped"]["empty"] == 1
  assert counts["examples"]["missing_field"] == [f"{tmp_path / 'a.parquet'}[4]"]
  assert read_all(tmp_path)[0] == texts
  assert_one_line_error(lambda: read_all(tmp_path, text_field="body"), "no column 'body'", "columns: text, n")
  assert_one_line_error(lambda: read_all(tmp_path / "a.parquet", text_field="n"), "type int64")
  (tmp_path / "c.parquet").write_text("not parquet")
  assert_one_line_error(lambda: read_all(tmp_path / "c.parquet"), "not a readable Parquet file")


def write_arrayrecord(path, records):
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()


def test_arrayrecord_text_and_json_records(tmp_path):
  write_arrayrecord(tmp_path / "t.arrayrecord", [t.encode() for t in TEXTS] + [b"bad \xff"])
  write_arrayrecord(tmp_path / "j.array_record",
                    [json.dumps({"text": t}).encode() for t in TEXTS] + [b"{oops", b'{"id": 3}'])
  texts, counts, pieces = read_all(tmp_path / "t.arrayrecord", piece_bytes=1)
  assert texts == TEXTS + ["bad \ufffd"] and len(pieces) == 5 and counts["repaired"]["invalid_utf8"] == 1
  texts, counts, pieces = read_all(tmp_path / "j.array_record")
  assert texts == TEXTS and {p.fmt for p in pieces} == {"arrayrecord_json"}
  assert counts["skipped"]["malformed_json"] == 1 and counts["skipped"]["missing_field"] == 1
  assert counts["examples"]["malformed_json"] == [f"{tmp_path / 'j.array_record'}[4]"]


def test_hf_dataset_on_disk(tmp_path):
  datasets = pytest.importorskip("datasets")
  datasets.disable_progress_bars()
  ds = datasets.Dataset.from_dict({"content": TEXTS + [None], "id": list(range(5))})
  ds.save_to_disk(str(tmp_path / "ds"))
  assert sources.list_files(str(tmp_path / "ds"), "auto") == [(str(tmp_path / "ds"), "hf")]
  texts, counts, pieces = read_all(tmp_path / "ds", text_field="content", piece_bytes=1)
  assert texts == TEXTS and counts["skipped"]["missing_field"] == 1 and len(pieces) == 5
  datasets.DatasetDict({"test": ds.select([0]), "train": ds.select([1, 2])}).save_to_disk(str(tmp_path / "dd"))
  assert read_all(tmp_path / "dd", text_field="content")[0] == TEXTS[1:3]
  assert_one_line_error(lambda: read_all(tmp_path / "ds"), "no column 'text'", "content, id")


def test_empty_files_count_and_piece_sizes(tmp_path):
  for name in ["a.txt", "b.jsonl", "c.parquet"]:
    (tmp_path / name).write_bytes(b"")
  pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "d.parquet")
  texts, counts, pieces = read_all(tmp_path)
  assert (texts, pieces, counts["empty_files"], counts["documents"]) == ([], [], 4, 0)
  want = [Piece("hf", "p", 0, 3, 0, 300), Piece("hf", "p", 3, 6, 3, 300), Piece("hf", "p", 6, 9, 6, 300),
          Piece("hf", "p", 9, 10, 9, 100)]
  assert sources._split("hf", "p", 10, 1000, 300) == want  # 10 rows of 100 bytes, pieces of 300


def test_symlink_loops_follow_each_directory_once(tmp_path):
  """The two loops of the report (`ln -s . d/self; ln -s .. d/sub/back`) once took 11 minutes and 6.9 GB."""
  d = tmp_path / "d"
  (d / "sub").mkdir(parents=True)
  (d / "a.txt").write_text("alpha")
  (d / "sub" / "b.txt").write_text("beta")
  os.symlink(".", d / "self")
  os.symlink("..", d / "sub" / "back")
  os.symlink("../a.txt", d / "sub" / "c_link.txt")  # the same file again: read once
  code = ("import json, sys; from jaxtrain.data import sources; from tests.data.test_sources import read_all; "
          "print(json.dumps([[p for p, _ in sources.list_files(s, 'auto')] for s in sys.argv[1:]] + "
          "[read_all(sys.argv[1])[0]]))")
  run = subprocess.run([sys.executable, "-c", code, str(d), f"{d}/**/*.txt", f"{d}/*/*.txt"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stderr[-2000:]
  by_dir, by_glob, by_star, texts = json.loads(run.stdout)
  assert by_dir == by_glob == [f"{d}/a.txt", f"{d}/sub/b.txt"]
  assert by_star == [f"{d}/self/a.txt", f"{d}/sub/b.txt"]  # `*/*.txt` names a.txt through self, not again
  assert texts == ["alpha", "beta"]


def zstd(data: bytes) -> bytes:
  return pa.Codec("zstd").compress(data, asbytes=True)


JSONL2 = b'{"text": "j1"}\n{"text": "j2"}\n'


def write_encoded_corpus(root):
  """Every byte-order mark and compression once (and a corrupt .gz); returns the kept texts in order."""
  root.mkdir()
  files = {"a_u16le.txt": "utf-16 \xe9 le".encode("utf-16-le"), "b_u16be.txt": "utf-16 be".encode("utf-16-be"),
           "c_u32le.txt": "utf-32 le \U0001d11e".encode("utf-32-le"), "d_u32be.txt": "utf-32 be".encode("utf-32-be")}
  marks = {"le": ("\ufeff".encode("utf-16-le"), "\ufeff".encode("utf-32-le")),
           "be": ("\ufeff".encode("utf-16-be"), "\ufeff".encode("utf-32-be"))}
  for name, raw in files.items():
    (root / name).write_bytes(marks[name[5:7]][name[3:5] == "32"] + raw)
  (root / "e_u8bom.txt").write_bytes("utf-8 bom".encode("utf-8-sig"))
  (root / "f_gz.txt.gz").write_bytes(gzip.compress(b"gzipped text"))
  (root / "g_zst.txt.zst").write_bytes(zstd(b"zstd text"))
  (root / "h_u16.txt.GZ").write_bytes(gzip.compress("both".encode("utf-16")))
  (root / "i_nobom.txt").write_bytes("no mark, so binary".encode("utf-16-le"))
  (root / "j_bad16.txt").write_bytes(codecs.BOM_UTF16_LE + "ok".encode("utf-16-le") + b"\x00\xd8" + b"!\x00")
  (root / "k_corrupt.txt.gz").write_bytes(b"this is not gzip")
  (root / "l_u16.jsonl").write_bytes(JSONL2.decode().encode("utf-16"))
  (root / "m.jsonl.gz").write_bytes(gzip.compress(JSONL2.replace(b"j", b"m")))
  (root / "n.ndjson.zst").write_bytes(zstd(JSONL2.replace(b"j", b"n")))
  (root / "o_u8bom.jsonl").write_bytes(codecs.BOM_UTF8 + JSONL2.replace(b"j", b"o"))
  lines = b"".join(b'{"text": "line %d"}\n' % i for i in range(3))  # 19 bytes each
  (root / "p_trunc.jsonl.gz").write_bytes(gzip.compress(lines)[:-8])  # the gzip trailer cut off
  return ["utf-16 \xe9 le", "utf-16 be", "utf-32 le \U0001d11e", "utf-32 be", "utf-8 bom", "gzipped text",
          "zstd text", "both", "ok\ufffd!", "j1", "j2", "m1", "m2", "n1", "n2", "o1", "o2"]


@pytest.mark.parametrize("piece_bytes", [1, 1 << 20])
def test_byte_order_marks_and_compressed_files_are_decoded_and_counted(tmp_path, piece_bytes, monkeypatch):
  kept = write_encoded_corpus(tmp_path / "c")
  c = tmp_path / "c"
  assert [f for _, f in sources.list_files(str(c), "auto")] == ["text"] * 11 + ["jsonl"] * 5
  texts, counts, pieces = read_all(c, piece_bytes=piece_bytes)
  assert texts == kept
  assert counts["converted"] == {"decompressed_gzip": 3, "decompressed_zstd": 2, "decoded_utf16": 5,
                                 "decoded_utf32": 2, "removed_utf8_bom": 2}
  assert counts["skipped"] == {"malformed_json": 0, "missing_field": 0, "empty": 0, "binary": 1,
                               "invalid_utf8": 0, "corrupt_compressed": 2}
  assert counts["repaired"] == {"invalid_utf8": 1, "nul": 0} and (counts["documents"], counts["kept"]) == (20, 17)
  ex = counts["examples"]
  assert ex["corrupt_compressed"] == [f"{c}/k_corrupt.txt.gz", f"{c}/p_trunc.jsonl.gz:1"]
  assert ex["decoded_utf16"] == [f"{c}/{n}" for n in ("a_u16le.txt", "b_u16be.txt", "h_u16.txt.GZ", "j_bad16.txt",
                                                       "l_u16.jsonl")]
  assert ex["decompressed_zstd"] == [f"{c}/g_zst.txt.zst", f"{c}/n.ndjson.zst"]
  assert ex["binary"] == [f"{c}/i_nobom.txt"] and ex["invalid_utf8"] == [f"{c}/j_bad16.txt"]
  # o_u8bom.jsonl (33 B) is cut into line pieces like any UTF-8 jsonl; the others are read whole
  assert sum(p.path.endswith("o_u8bom.jsonl") for p in pieces) == (2 if piece_bytes == 1 else 1)
  # Lines that decompressed before the damage are kept: with 16-byte reads, 48 of 57 bytes (2 lines).
  monkeypatch.setattr(decoding, "CHUNK", 16)
  texts, counts, _ = read_all(c / "p_trunc.jsonl.gz")
  assert texts == ["line 0", "line 1"] and counts["examples"]["corrupt_compressed"] == [f"{c}/p_trunc.jsonl.gz:3"]
  assert (counts["documents"], counts["converted"]["decompressed_gzip"]) == (3, 0)


def test_compressed_formats_other_than_text_and_jsonl_are_one_line_errors(tmp_path):
  (tmp_path / "t.parquet.gz").write_bytes(gzip.compress(b"x"))
  assert_one_line_error(lambda: sources.list_files(str(tmp_path), "auto"), "t.parquet.gz", "decompress it")
  assert sources.format_of("a.JSONL.zst", "auto") == "jsonl" and sources.format_of("a.gz", "auto") == "text"
