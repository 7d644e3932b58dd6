"""Kind "text" end to end: prepare -> cache -> grain pipeline -> train -> resume -> sample."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import metrics
from jaxtrain.__main__ import main
from tests.fixtures import ROOT, tiny_config


def corpus(tmp_path):
  root = tmp_path / "corpus"
  (root / "txt").mkdir(parents=True)
  for i in range(8):
    (root / "txt" / f"{i}.txt").write_text(f"file {i}: " + "lorem ipsum dolor sit amet. " * (3 + i))
  with open(root / "docs.jsonl", "w") as f:
    for i in range(20):
      f.write(json.dumps({"text": f"record {i} " + "the cat sat on the mat. " * (i % 5 + 1)}) + "\n")
  return f"{root}/txt/*.txt@0.5,{root}/docs.jsonl@0.5"


def text_config(path, **train):
  cfg = tiny_config(model=dict(vocab_size=264, max_seq_len=32), mesh=dict(data=2, fsdp=2, tensor=2, rules="fsdp_tp"),
                    train={**dict(steps=4, batch_size=8, seq_len=16, eval_every=2, eval_batches=1), **train},
                    checkpoint=dict(every_steps=2))
  cfg.data.update(kind="text", path=path, tokenizer="byte", eval_fraction=0.2)
  return cfg


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_text_kind_trains_resumes_bitwise_and_samples(tmp_path):
  cfg = text_config(corpus(tmp_path))
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(straight) if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)
  assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
  report = json.load(open(os.path.join(straight, "data_cache", "report.json")))
  assert report["documents"] == report["kept"] == 28 and report["files"] == 9

  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["step"] for r in again] == [3, 4]
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[2:]]  # the data order resumed exactly

  text = jaxtrain.sample(straight, "the ", max_new_tokens=6, temperature=0.0, top_k=0)
  assert isinstance(text, str)


def test_prepare_cli_and_bad_corpus(tmp_path, capsys):
  path = corpus(tmp_path)
  assert main(["prepare", f"--config={ROOT}/configs/text_tiny.py", f"--workdir={tmp_path}/w",
               f"--config.data.path={path}"]) == 0
  assert "document" in capsys.readouterr().out
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "a.txt").write_text("")
  code = main(["prepare", f"--config={ROOT}/configs/text_tiny.py", f"--workdir={tmp_path}/w2",
               f"--config.data.path={tmp_path}/empty/*.txt"])
  lines = capsys.readouterr().err.strip().splitlines()  # after prepare's progress bar: one error line
  assert code == 2 and lines[-1].startswith("error: ") and "no usable text" in lines[-1], lines
  assert sum(line.startswith("error") for line in lines) == 1


def test_corpus_of_every_bad_case_trains_and_is_counted(tmp_path):
  from tests.data.test_prepare import write_bad_corpus
  write_bad_corpus(tmp_path / "bad")
  cfg = text_config(str(tmp_path / "bad"), steps=2)
  cfg.train.update(eval_every=0)
  cfg.mesh.update(data=-1, fsdp=1, tensor=1, rules="dp")
  final = jaxtrain.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1], progress=False)
  assert np.isfinite(final["loss"])
  r = json.load(open(tmp_path / "run" / "data_cache" / "report.json"))
  assert (r["files"], r["empty_files"], r["documents"], r["kept"]) == (7, 1, 10, 6)
  assert r["skipped"] == {"malformed_json": 1, "missing_field": 1, "empty": 1, "binary": 1, "invalid_utf8": 0,
                          "corrupt_compressed": 0}
  # longer than seq_len=16 with BOS/EOS: the latin-1 (17), NUL (19) and long (302) documents
  assert r["repaired"] == {"invalid_utf8": 1, "nul": 1} and r["long_documents"] == 3


@pytest.mark.slow  # 25 s; tests/test_model.py checks that attention never crosses documents by default
def test_packed_row_loss_per_document_equals_documents_alone(tmp_path):
  """The pipeline's segment_ids/positions make a packed row exactly the documents run separately."""
  import flax.linen as nn
  import jax.numpy as jnp
  from jaxtrain.data import cache, pipeline
  from jaxtrain.model import ModelConfig, Transformer
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 250, size=n) for n in rng.integers(3, 12, size=40)]
  cache.write_cache(str(tmp_path / "c"), docs, 264, "test")
  batch = next(pipeline.TextPipeline([str(tmp_path / "c")], None, 32, 4, 0, "train", 0.1))
  cfg = tiny_config(model=dict(vocab_size=264, max_seq_len=32))
  model = Transformer(ModelConfig.from_config(cfg.model))
  params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))["params"])
  apply = jax.jit(model.apply)

  def token_losses(inputs, targets, positions=None, segments=None):
    logits = apply({"params": params}, inputs, positions, segments)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]

  packed = token_losses(*(jnp.asarray(batch[k]) for k in ("inputs", "targets", "positions", "segment_ids")))
  checked = 0
  for row in range(batch["inputs"].shape[0]):
    for seg in set(batch["segment_ids"][row]) - {0}:
      cols = np.nonzero(batch["segment_ids"][row] == seg)[0]
      alone = token_losses(jnp.asarray(batch["inputs"][row, cols])[None], jnp.asarray(batch["targets"][row, cols])[None])
      np.testing.assert_allclose(packed[row, cols], alone[0], rtol=1e-5, atol=1e-6)
      assert np.all(batch["positions"][row, cols] == np.arange(len(cols)))
      checked += 1
  assert checked >= 8  # several documents per row were packed
