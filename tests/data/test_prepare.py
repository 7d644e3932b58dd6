"""prepare: exact bad-input counts, cache round trip, 1 == 2 workers, kill -9 resume, invalidation."""

import filecmp
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtrain.config import default_config
from jaxtrain.data.cache import Cache, read_manifest
from jaxtrain.data.prepare import RUN_KEYS, corpus_texts, prepare, prepare_source, rules_of
from jaxtrain.data.report import format_report
from jaxtrain.data.sources import DataError
from jaxtrain.data.tokenizers import Bytes
from tests.fixtures import ROOT

CACHE_FILES = ("tokens.bin", "offsets.npy", "manifest.json", "report.json")
LONG = "y" * 300


def rules(**changes):
  """The default config's rules with some data.* values changed."""
  return rules_of(default_config().data)._replace(**changes)


class CountingBytes(Bytes):
  """Byte tokenizer that counts encode calls; `fp` changes its fingerprint, `on_first` runs once."""

  def __init__(self, fp="byte", on_first=None):
    self.calls, self.fp, self.on_first = 0, fp, on_first

  def encode(self, text):
    if self.calls == 0 and self.on_first:
      self.on_first()
    self.calls += 1
    return super().encode(text)

  def fingerprint(self):
    return super().fingerprint() if self.fp == "byte" else self.fp


class SlowBytes(Bytes):
  """For the kill -9 test: slow enough that the run is killed between shards."""

  def encode(self, text):
    time.sleep(0.05)
    return super().encode(text)


def write_bad_corpus(root):
  """Every bad case once, beside two good text files; returns (expected kept texts, seq_len)."""
  root.mkdir()
  (root / "a_good.txt").write_text("hello world\n")
  (root / "b_latin1.txt").write_bytes(b"caf\xe9 au lait\n")
  (root / "c_nul.txt").write_bytes(b"ab\x00cd\x00efghijklmnop\n")
  (root / "d_binary.bin").write_bytes(np.random.default_rng(0).bytes(2000))
  (root / "e_empty.txt").write_bytes(b"")
  (root / "f_docs.jsonl").write_text("\n".join([json.dumps({"text": "json one"}), json.dumps({"text": ""}),
                                                "{not json", json.dumps({"title": "no text"}),
                                                json.dumps({"text": LONG})]) + "\n")
  (root / "g_good.txt").write_text("the end")
  kept = ["hello world\n", "caf\ufffd au lait\n", "abcdefghijklmnop\n", "json one", LONG, "the end"]
  return kept, 64


def expected_docs(texts, bos=True, eos=True):
  tok = Bytes()
  return [np.concatenate([[tok.bos] * bos, tok.encode(t), [tok.eos] * eos]).astype(np.int32) for t in texts]


def cache_docs(path):
  c = Cache(str(path))
  return [c[i] for i in range(len(c))]


def assert_docs(path, texts, **kw):
  got, want = cache_docs(path), expected_docs(texts, **kw)
  assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def assert_same_cache(a, b):
  for f in CACHE_FILES:
    assert filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False), f


def test_every_bad_case_is_counted_exactly(tmp_path):
  kept, seq_len = write_bad_corpus(tmp_path / "corpus")
  r = prepare_source(str(tmp_path / "corpus"), str(tmp_path / "cache"), Bytes(), rules(), seq_len=seq_len,
                     shard_bytes=64)
  assert (r["files"], r["empty_files"], r["documents"], r["kept"]) == (7, 1, 10, 6)
  assert r["skipped"] == {"malformed_json": 1, "missing_field": 1, "empty": 1, "binary": 1, "invalid_utf8": 0,
                       "corrupt_compressed": 0}
  assert r["repaired"] == {"invalid_utf8": 1, "nul": 1} and r["nul_bytes_removed"] == 2
  assert (r["long_documents"], r["max_document_tokens"]) == (1, 302)
  c = str(tmp_path / "corpus")
  assert r["examples"] == {"empty_files": [f"{c}/e_empty.txt"], "invalid_utf8": [f"{c}/b_latin1.txt"],
                           "nul": [f"{c}/c_nul.txt"], "binary": [f"{c}/d_binary.bin"],
                           "empty": [f"{c}/f_docs.jsonl:2"], "malformed_json": [f"{c}/f_docs.jsonl:3"],
                           "missing_field": [f"{c}/f_docs.jsonl:4"]}
  assert_docs(tmp_path / "cache", kept)  # repaired documents are the tokenizer applied to the repaired text
  num_tokens = read_manifest(str(tmp_path / "cache"))["num_tokens"]
  assert r["tokens"] == sum(len(d) for d in expected_docs(kept)) == num_tokens
  with open(tmp_path / "cache" / "report.json") as f:
    assert json.load(f) == {k: v for k, v in r.items() if k not in RUN_KEYS}


def test_skip_rule_and_bos_eos_rules(tmp_path):
  kept, _ = write_bad_corpus(tmp_path / "corpus")
  r = prepare_source(str(tmp_path / "corpus"), str(tmp_path / "cache"), Bytes(),
                     rules(bad_utf8="skip", add_bos=False), seq_len=300)
  assert r["skipped"]["invalid_utf8"] == 1 and r["repaired"]["invalid_utf8"] == 0 and r["kept"] == 5
  assert r["long_documents"] == 1  # 301 tokens > 300
  assert_docs(tmp_path / "cache", [t for t in kept if "caf" not in t], bos=False)


def test_cache_content_does_not_depend_on_shard_size(tmp_path):
  kept, _ = write_bad_corpus(tmp_path / "corpus")
  pq.write_table(pa.table({"text": ["p0", "p1", "p2", "p3", "p4"]}), tmp_path / "corpus" / "h.parquet",
                 row_group_size=2)
  runs = [prepare_source(str(tmp_path / "corpus"), str(tmp_path / f"c{b}"), Bytes(), rules(), shard_bytes=b)
          for b in (1, 50, 1 << 30)]
  assert runs[0]["shards"] == 13 and 1 < runs[1]["shards"] < 13 and runs[2]["shards"] == 1  # 13 pieces
  assert_docs(tmp_path / "c1", kept + ["p0", "p1", "p2", "p3", "p4"])
  for b in (50, 1 << 30):
    assert_same_cache(str(tmp_path / "c1"), str(tmp_path / f"c{b}"))


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
  write_bad_corpus(tmp_path / "corpus")
  pq.write_table(pa.table({"text": [f"row {i}" for i in range(20)]}), tmp_path / "corpus" / "h.parquet",
                 row_group_size=3)
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(tmp_path / "corpus" / "i.arrayrecord"), "group_size:1")
  for i in range(6):
    writer.write(json.dumps({"text": f"record {i}"}).encode())
  writer.close()
  one, two = (prepare_source(str(tmp_path / "corpus"), str(tmp_path / name), Bytes(), rules(), workers=w,
                             shard_bytes=40) for name, w in (("one", 1), ("two", 2)))
  assert one["shards"] == two["shards"] >= 8 and one["kept"] == two["kept"] == 32
  tail = [Bytes().decode(d) for d in cache_docs(tmp_path / "two")][-7:]
  assert tail == ["row 19"] + [f"record {i}" for i in range(6)]
  assert_same_cache(str(tmp_path / "one"), str(tmp_path / "two"))


def test_kill_9_then_rerun_resumes_and_equals_an_uninterrupted_run(tmp_path):
  corpus, cache = tmp_path / "corpus", tmp_path / "cache"
  corpus.mkdir()
  for i in range(20):
    (corpus / f"{i:02d}.txt").write_text(f"document {i:02d} " + "z" * 38)  # 50 bytes: 2 per shard
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from test_prepare import SlowBytes; "
          f"from test_prepare import prepare_source, rules; "
          f"prepare_source({str(corpus)!r}, {str(cache)!r}, SlowBytes(), rules(), shard_bytes=100)")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                          env={**os.environ, "PYTHONPATH": ROOT})  # this checkout's jaxtrain, not an installed one
  deadline = time.time() + 60
  while len(glob.glob(str(cache / "shards-*" / "*.npz"))) < 3 and time.time() < deadline and proc.poll() is None:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  shards = sorted(glob.glob(str(cache / "shards-*" / "*.npz")))
  assert 3 <= len(shards) < 10 and read_manifest(str(cache)) is None
  mtimes = {f: os.stat(f).st_mtime_ns for f in shards}
  corrupt = os.path.join(os.path.dirname(shards[0]), f"{len(shards):05d}.npz")
  with open(corrupt, "wb") as f:
    f.write(b"half a shard")  # a torn write (not possible from kill -9, but from a power loss): redone
  seen = {}
  tok = CountingBytes(on_first=lambda: seen.update({f: os.stat(f).st_mtime_ns for f in shards}))
  r = prepare_source(str(corpus), str(cache), tok, rules(), shard_bytes=100)
  assert (r["shards"], r["shards_reused"], tok.calls) == (10, len(shards), 2 * (10 - len(shards)))
  assert seen == mtimes  # finished shards untouched when new work began
  prepare_source(str(corpus), str(tmp_path / "whole"), Bytes(), rules(), shard_bytes=100)
  assert_same_cache(str(cache), str(tmp_path / "whole"))
  assert not glob.glob(str(cache / "shards-*"))


def test_invalidation(tmp_path):
  corpus, cache = tmp_path / "corpus", str(tmp_path / "cache")
  corpus.mkdir()
  (corpus / "a.txt").write_text("alpha")
  (corpus / "b.jsonl").write_text('{"text": "beta", "alt": "gamma"}\n')

  def run(tok=None, **changes):
    tok = tok or CountingBytes()
    r = prepare_source(str(corpus), cache, tok, rules(**changes))
    return tok.calls, r["cache_reused"], [Bytes().decode(d) for d in cache_docs(cache)]

  assert run() == (2, False, ["alpha", "beta"])
  assert run() == (0, True, ["alpha", "beta"])
  st = os.stat(corpus / "a.txt")
  (corpus / "a.txt").write_text("ALPHA")  # same size, same mtime: only the content hash tells
  os.utime(corpus / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
  assert run() == (2, False, ["ALPHA", "beta"])
  assert run(CountingBytes(fp="other")) == (2, False, ["ALPHA", "beta"])
  assert run(CountingBytes(fp="other")) == (0, True, ["ALPHA", "beta"])
  assert run(text_field="alt") == (2, False, ["ALPHA", "gamma"])
  assert run(add_eos=False)[:2] == (2, False)
  (corpus / "c.txt").write_text("new file")
  assert run() == (3, False, ["ALPHA", "beta", "new file"])


def test_prepare_mixture_writes_one_cache_per_source_and_a_total_report(tmp_path, capsys):
  kept, _ = write_bad_corpus(tmp_path / "corpus")
  (tmp_path / "more.jsonl").write_text('{"body": "m1"}\n{"body": "m2"}\n')
  datasets = pytest.importorskip("datasets")
  datasets.disable_progress_bars()
  datasets.Dataset.from_dict({"body": ["h1", "h2", "h3"]}).save_to_disk(str(tmp_path / "hf"))
  cfg = default_config()
  cfg.data.update(path=f"{tmp_path}/corpus/*.txt@3,{tmp_path}/more.jsonl,{tmp_path}/hf", text_field="body",
                  prepare_workers=1)
  cfg.train.seq_len = 8
  r = prepare(cfg, str(tmp_path / "run"), Bytes())
  assert [(s["source"], s["weight"]) for s in r["sources"]] == [
      (f"{tmp_path}/corpus/*.txt", 0.6), (f"{tmp_path}/more.jsonl", 0.2), (f"{tmp_path}/hf", 0.2)]
  assert (r["files"], r["empty_files"], r["documents"], r["kept"], r["long_documents"]) == (7, 1, 9, 9, 4)
  assert r["tokens"] == sum(s["tokens"] for s in r["sources"]) == 79  # 59 + 8 + 12
  assert r["cache_dir"] == str(tmp_path / "run" / "data_cache")
  assert_docs(r["sources"][1]["cache"], ["m1", "m2"])
  assert_docs(r["sources"][2]["cache"], ["h1", "h2", "h3"])
  assert_docs(r["sources"][0]["cache"], ["hello world\n", "caf\ufffd au lait\n", "abcdefghijklmnop\n", "the end"])
  with open(r["report_path"]) as f:
    assert json.load(f)["kept"] == 9
  out = capsys.readouterr().out
  assert out.replace(str(tmp_path), "T") == "\n".join([
      "data: 3 source(s), 7 file(s) (1 empty), 9 document(s): 9 kept, 79 tokens",
      "  empty files 1 (T/corpus/e_empty.txt)",
      "  repaired 2: invalid_utf8 1 (T/corpus/b_latin1.txt); nul 1 (T/corpus/c_nul.txt)",
      "  NUL bytes removed: 2",
      "  long documents (> seq_len 8 tokens, split by the pipeline): 4; longest 19 tokens",
      "  report: T/run/data_cache/report.json", ""])
  assert list(corpus_texts(cfg)) == kept[:3] + ["the end", "m1", "m2", "h1", "h2", "h3"]
  assert prepare(cfg, str(tmp_path / "run"), Bytes(), progress=False)["cache_reused"]
  cfg.data.cache_dir = str(tmp_path / "elsewhere")
  again = prepare(cfg, str(tmp_path / "run"), Bytes(), progress=False)
  assert not again["cache_reused"] and again["sources"][2]["cache"].startswith(cfg.data.cache_dir)


def test_no_usable_text_missing_and_unreadable_paths_are_one_line_errors(tmp_path):
  (tmp_path / "junk").mkdir()
  (tmp_path / "junk" / "empty.txt").write_bytes(b"")
  (tmp_path / "junk" / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
  (tmp_path / "junk" / "blank.txt").write_text("  \n")
  cases = [(tmp_path / "junk", "no usable text in 3 file(s) (1 empty; skipped: 1 empty, 1 binary)"),
           (tmp_path / "missing", "does not exist")]
  os.mkfifo(tmp_path / "fifo.txt")
  cases.append((tmp_path / "fifo.txt", "not a regular file"))
  for path, fragment in cases:
    cfg = default_config()
    cfg.data.update(path=str(path), prepare_workers=1)
    with pytest.raises(DataError) as e:
      prepare(cfg, str(tmp_path / "run"), Bytes(), progress=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)
  reports = glob.glob(str(tmp_path / "run" / "data_cache" / "*junk-*" / "report.json"))
  assert len(reports) == 1 and json.load(open(reports[0]))["skipped"]["binary"] == 1


def test_decoded_and_decompressed_files_are_in_the_report(tmp_path):
  from tests.data.test_sources import write_encoded_corpus
  kept = write_encoded_corpus(tmp_path / "c")
  one, two = (prepare_source(str(tmp_path / "c"), str(tmp_path / name), Bytes(), rules(), workers=w, shard_bytes=40)
              for name, w in (("one", 1), ("two", 2)))
  assert_docs(tmp_path / "one", kept)
  assert_same_cache(str(tmp_path / "one"), str(tmp_path / "two"))
  assert one["converted"] == two["converted"] == {"decompressed_gzip": 3, "decompressed_zstd": 2, "decoded_utf16": 5,
                                                  "decoded_utf32": 2, "removed_utf8_bom": 2}
  assert (one["skipped"]["corrupt_compressed"], one["skipped"]["binary"], one["kept"]) == (2, 1, 17)
  lines = format_report(one).replace(str(tmp_path / "c"), "C").splitlines()
  assert lines[1:3] == [
      "  converted 14: decompressed_gzip 3 (C/f_gz.txt.gz, C/h_u16.txt.GZ, ...); decompressed_zstd 2 "
      "(C/g_zst.txt.zst, C/n.ndjson.zst); decoded_utf16 5 (C/a_u16le.txt, C/b_u16be.txt, ...); decoded_utf32 2 "
      "(C/c_u32le.txt, C/d_u32be.txt); removed_utf8_bom 2 (C/e_u8bom.txt, C/o_u8bom.jsonl)",
      "  skipped 3: binary 1 (C/i_nobom.txt); corrupt_compressed 2 (C/k_corrupt.txt.gz, C/p_trunc.jsonl.gz:1)"]
