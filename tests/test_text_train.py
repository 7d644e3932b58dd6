"""Kind "text" end to end: prepare -> cache -> grain pipeline -> train -> resume -> sample."""

import json
import os
import shutil

import jax
import numpy as np

import jaxtrain
from jaxtrain import metrics
from jaxtrain.__main__ import main
from tests.conftest import tiny_config


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
                    train=dict(steps=4, batch_size=8, seq_len=16, eval_every=2, eval_batches=1, **train),
                    checkpoint=dict(every_steps=2))
  cfg.data.update(kind="text", path=path, tokenizer="byte", eval_fraction=0.2)
  return cfg


def test_text_kind_trains_resumes_bitwise_and_samples(tmp_path):
  cfg = text_config(corpus(tmp_path))
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  rows = metrics.read_metrics(straight)
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)
  assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
  report = json.load(open(os.path.join(straight, "data_cache", "report.json")))
  assert report["documents"] == report["kept"] == 28 and report["files"] == 9

  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  again = metrics.read_metrics(resumed)
  assert [r["step"] for r in again] == [3, 4]
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[2:]]  # the data order resumed exactly

  text = jaxtrain.sample(straight, "the ", max_new_tokens=6, temperature=0.0, top_k=0)
  assert isinstance(text, str)


def test_prepare_cli_and_bad_corpus(tmp_path, capsys):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = corpus(tmp_path)
  assert main(["prepare", f"--config={root}/configs/text_tiny.py", f"--workdir={tmp_path}/w",
               f"--config.data.path={path}"]) == 0
  assert "document" in capsys.readouterr().out
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "a.txt").write_text("")
  code = main(["prepare", f"--config={root}/configs/text_tiny.py", f"--workdir={tmp_path}/w2",
               f"--config.data.path={tmp_path}/empty/*.txt"])
  lines = capsys.readouterr().err.strip().splitlines()  # after prepare's progress bar: one error line
  assert code == 2 and lines[-1].startswith("error: ") and "no usable text" in lines[-1], lines
  assert sum(line.startswith("error") for line in lines) == 1
