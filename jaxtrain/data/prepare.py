"""`prepare`: tokenize a corpus once into token caches (cache.py), over all cores, resumable.
No jax.

Each data.path entry gets its own cache, CACHE_ROOT/NAME-HASH (cache_layout), CACHE_ROOT being
data.cache_dir or WORKDIR/data_cache. A cache is reused, with no work, while its fingerprint holds:
the file list with sizes and mtimes (and content hashes of files up to 1 MiB), the tokenizer's
fingerprint, and the rules (format, text_field, add_bos, add_eos, bad_utf8). Otherwise its manifest
is removed first, so a stale cache never looks complete, and it is rebuilt.

Building: the source's pieces (sources.py) are grouped in order into shards of about shard_bytes
of input. Workers (child processes, workers.py: safe beside jax's threads, and a script that calls
prepare needs no `if __name__ == "__main__":` guard) tokenize one shard each (shards.py) and write
CACHE/shards-KEY/NNNNN.npz through an atomic rename, so a killed run (even kill -9) leaves only
whole shards, which a rerun skips. When all are done they are concatenated in order (the same
bytes for any number of workers), report.json is written, then the manifest, and the shards go.
"""

import hashlib
import json
import os
import re
import shutil

import numpy as np
import tqdm

from jaxtrain.data import cache as cache_lib
from jaxtrain.data import report as report_lib
from jaxtrain.data import sources, splits
from jaxtrain.data import shards as shards_lib
from jaxtrain.data import workers as workers_lib
from jaxtrain.data.shards import Rules
from jaxtrain.data.sources import DataError

# bump when the cache layout or a rule changes (2: BOM-marked and compressed files decoded)
VERSION = 2
SMALL_FILE = 1 << 20  # files up to this size are hashed into the fingerprint
MIN_SHARD, MAX_SHARD = 1 << 20, 64 << 20  # default shards: 1/256 of the input within these bounds
# returned, not in report.json
RUN_KEYS = ("cache", "weight", "cache_reused", "shards", "shards_reused")


def rules_of(data_cfg) -> Rules:
  d = data_cfg
  return Rules(d.format, d.text_field, bool(d.add_bos), bool(d.add_eos), d.bad_utf8)


def cache_root(cfg, workdir: str) -> str:
  return cfg.data.cache_dir or os.path.join(workdir, "data_cache")


def cache_layout(cfg, workdir: str) -> list[tuple[str, float, str]]:
  """(spec, weight, cache directory) of each data.path source; weights sum to 1."""
  root = cache_root(cfg, workdir)
  layout = []
  for spec, weight in sources.parse_mixture(cfg.data.path):
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec).strip("_.")[-40:] or "source"
    layout.append(
        (spec, weight, os.path.join(root, f"{name}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}")))
  return layout


def _stamp(path: str) -> list:
  """[path, size, mtime_ns, sha256 of the content or None for a large file]."""
  try:
    st = os.stat(path)
    digest = None
    if st.st_size <= SMALL_FILE:
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None
  return [path, st.st_size, st.st_mtime_ns, digest]


def stamps(files: list[tuple[str, str]]) -> list[list]:
  """Stamps of every file (every file inside a saved HF dataset)."""
  paths = []
  for path, fmt in files:
    paths += sorted(os.path.join(d, f) for d, _, fs in os.walk(path)
                    for f in fs) if fmt == "hf" else [path]
  return [_stamp(p) for p in paths]


def fingerprint(spec: str, file_stamps: list, tokenizer_fingerprint: str, rules: Rules) -> str:
  key = {"version": VERSION, "spec": spec, "files": file_stamps, "tokenizer": tokenizer_fingerprint,
         "rules": rules._asdict()}
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def plan_shards(pieces: list, shard_bytes: int) -> list[list]:
  """Consecutive pieces grouped until each group holds at least shard_bytes (the last may not)."""
  shards, group, size = [], [], 0
  for piece in pieces:
    group.append(piece)
    size += piece.size
    if size >= shard_bytes:
      shards.append(group)
      group, size = [], 0
  return shards + [group] if group else shards


def _run(tokenizer, tasks, workers):
  """(index, counts) of each task as it finishes; in this process when one worker is enough."""
  if workers <= 1 or len(tasks) <= 1:
    yield from (shards_lib.run_shard(tokenizer, *task) for task in tasks)
    return
  yield from workers_lib.run(tokenizer.spec(), tasks, workers)


def _shard_dir(cache_path: str, fp: str, shard_bytes: int) -> str:
  """This build's shard directory; any other (stale) one is deleted, as are half-written files."""
  key = hashlib.sha256(f"{fp}/{shard_bytes}".encode()).hexdigest()[:16]
  path = os.path.join(cache_path, f"shards-{key}")
  for name in os.listdir(cache_path):
    if name.startswith("shards-") and name != os.path.basename(path):
      shutil.rmtree(os.path.join(cache_path, name), ignore_errors=True)
  os.makedirs(path, exist_ok=True)
  for name in os.listdir(path):
    if ".tmp" in name:
      os.remove(os.path.join(path, name))
  return path


def _write_json(path: str, obj) -> None:
  """Atomic; no write when the file already holds obj
  (a reused cache may sit on a read-only disk)."""
  if _read_json(path) == obj:
    return
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _finish(report: dict, cache_path: str, seq_len: int | None) -> dict:
  """Adds long_documents (more than seq_len tokens) and the longest; rewrites report.json."""
  lengths = np.diff(np.load(os.path.join(cache_path, "offsets.npy")))
  report.update(seq_len=seq_len, long_documents=int((lengths > seq_len).sum()) if seq_len else 0,
                max_document_tokens=int(lengths.max()) if lengths.size else 0)
  _write_json(os.path.join(cache_path, "report.json"),
              {k: v
               for k, v in report.items() if k not in RUN_KEYS})
  return report


def _no_text(spec: str, counts: dict) -> DataError:
  cases = [f"{n} {case}" for case, n in counts["skipped"].items() if n]
  detail = f"; skipped: {', '.join(cases)}" if cases else ""
  return DataError(f"data.path entry {spec!r}: no usable text in {counts['files']} file(s) "
                   f"({counts['empty_files']} empty{detail})")


def prepare_source(spec: str, cache_path: str, tokenizer, rules: Rules, workers: int = 1,
                   progress: bool = False, seq_len: int | None = None,
                   shard_bytes: int | None = None) -> dict:
  """Builds (or reuses) the cache of one source at cache_path; returns its report (report.py)."""
  files = sources.list_files(spec, rules.fmt)
  file_stamps = stamps(files)
  fp = fingerprint(spec, file_stamps, tokenizer.fingerprint(), rules)
  manifest = cache_lib.read_manifest(cache_path)
  saved = _read_json(os.path.join(cache_path, "report.json"))
  run = {"cache": cache_path, "cache_reused": True, "shards": 0, "shards_reused": 0}
  if manifest and manifest["fingerprint"] == fp and saved:
    return _finish({**saved, **run}, cache_path, seq_len)

  os.makedirs(cache_path, exist_ok=True)
  if os.path.exists(os.path.join(cache_path, cache_lib.MANIFEST)):
    os.remove(os.path.join(cache_path, cache_lib.MANIFEST))
  counts = report_lib.new_counts()
  # a saved dataset is 1 file
  counts.update(files=len(files), input_bytes=sum(s[1] for s in file_stamps))
  shard_bytes = shard_bytes or min(max(counts["input_bytes"] // 256, MIN_SHARD), MAX_SHARD)
  shards = plan_shards(sources.plan_pieces(files, rules.text_field, shard_bytes, counts),
                       shard_bytes)
  shard_dir = _shard_dir(cache_path, fp, shard_bytes)
  paths = [os.path.join(shard_dir, f"{i:05d}.npz") for i in range(len(shards))]
  done = {i: c for i, c in enumerate(map(shards_lib.shard_counts, paths)) if c is not None}
  tasks = [(i, shards[i], rules, paths[i]) for i in range(len(shards)) if i not in done]
  sizes = [sum(p.size for p in shard) for shard in shards]
  bar = tqdm.tqdm(total=sum(sizes), initial=sum(sizes[i] for i in done), unit="B", unit_scale=True,
                  desc=os.path.basename(cache_path), disable=not progress)
  with bar:
    for index, shard_counts in _run(tokenizer, tasks, workers):
      done[index] = shard_counts
      bar.update(sizes[index])
  for i in range(len(shards)):
    report_lib.merge(counts, done[i])
  report = {"source": spec, "format": rules.fmt, **counts}
  if not counts["kept"]:
    _write_json(os.path.join(cache_path, "report.json"), report)
    raise _no_text(spec, counts)

  _write_json(os.path.join(cache_path, "report.json"), report)
  cache_lib.write_chunks(cache_path, shards_lib.shard_chunks(paths), tokenizer.vocab_size, fp,
                         source=spec, format=rules.fmt, tokenizer=tokenizer.spec())
  shutil.rmtree(shard_dir, ignore_errors=True)
  run.update(cache_reused=False, shards=len(shards), shards_reused=len(shards) - len(tasks))
  return _finish({**report, **run}, cache_path, seq_len)


def _cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_splits(cfg, layout) -> None:
  """A one-line DataError naming the flag that fixes it when a cache cannot give training (or, with
  train.eval_every, evaluation) a next-token pair; the pipeline splits the same way (splits.py)."""
  d, t = cfg.data, cfg.train
  if t.eval_every and not d.eval_fraction > 0:
    raise DataError("train.eval_every needs held-out text: set --config.data.eval_fraction=0.05 "
                    "(or --config.train.eval_every=0)")
  for spec, _, path in layout:
    offsets = np.load(os.path.join(path, "offsets.npy"))
    cut = splits.split(offsets, d.eval_fraction, t.batch_size * t.seq_len + 1)
    for name, ranges in [("training", cut.train)] + [("eval", cut.eval)] * bool(t.eval_every):
      if not splits.pairs(ranges):
        fix = " or set --config.train.eval_every=0" if name == "eval" else ""
        raise DataError(f"data.path entry {spec!r}: {len(offsets) - 1} document(s), "
                        f"{offsets[-1]} tokens: too little text for a {name} split; add text{fix}")


def prepare(cfg, workdir: str, tokenizer, seq_len: int | None = None,
            progress: bool = True) -> dict:
  """Prepares every source of cfg.data.path; returns the combined report (also
  CACHE_ROOT/report.json) with one entry per source under "sources". seq_len defaults to
  train.seq_len. Fails (check_splits) when a source is too small to split for training and
  evaluation."""
  seq_len = cfg.train.seq_len if seq_len is None else seq_len
  workers = cfg.data.prepare_workers or _cores()
  rules = rules_of(cfg.data)
  layout = cache_layout(cfg, workdir)
  reports = [{**prepare_source(spec, path, tokenizer, rules, workers, progress, seq_len),
              "weight": weight}
             for spec, weight, path in layout]
  check_splits(cfg, layout)
  total = {"seq_len": seq_len, "cache_dir": cache_root(cfg, workdir)}
  for r in reports:
    report_lib.merge(total, {k: v for k, v in r.items() if k != "seq_len"})
  total.update(sources=reports, cache_reused=all(r["cache_reused"] for r in reports),
               report_path=os.path.join(total["cache_dir"], "report.json"))
  _write_json(total["report_path"], total)
  if progress:
    print(report_lib.format_report(total), flush=True)
  return total


def corpus_texts(cfg):
  """The clean text of every usable document of every data.path source, in order
  (to train a BPE)."""
  rules = rules_of(cfg.data)
  for spec, _ in sources.parse_mixture(cfg.data.path):
    counts = report_lib.new_counts()
    pieces = sources.plan_pieces(sources.list_files(spec, rules.fmt), rules.text_field, MAX_SHARD,
                                 counts)
    yield from sources.iter_texts(pieces, rules.text_field, rules.bad_utf8, counts)
