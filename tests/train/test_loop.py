"""End to end through the library API: metrics files, resume, sampling, convergence (slow)."""

import os
import shutil

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import checkpoint, metrics
from jaxtrain.config import ConfigError
from jaxtrain.config_files import load_config_file
from jaxtrain import builder
from jaxtrain.train import loop, workdir as workdir_lib
from tests.fixtures import ROOT, tiny_config
KEYS = {"step", "loss", "tokens_per_sec", "mfu", "grad_norm", "lr", "step_time_s", "entropy_floor"}


def final_params(workdir):
  cfg = workdir_lib.load_config(workdir)
  mesh, task, tx, _ = builder.build(cfg, workdir)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, read_only=True)
  state = builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  return jax.device_get(state.params)


def test_train_writes_metrics_and_resumes_bitwise(tmp_path):
  cfg = tiny_config(train=dict(steps=6, eval_every=3, eval_batches=1), checkpoint=dict(every_steps=3),
                    mesh=dict(data=2, fsdp=2, tensor=2, rules="fsdp_tp"))
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  final = jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  rows = metrics.read_metrics(straight)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
  assert KEYS <= set(train_rows[0])
  assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]  # in the same row as the step
  assert os.listdir(os.path.join(straight, "tb"))
  assert np.isfinite(final["loss"]) and 0 < final["mfu"] < 1

  # a run stopped after step 3: drop what came later, rerun the same command, compare
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  resumed_rows = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["step"] for r in resumed_rows] == [4, 5, 6]
  assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in train_rows[3:]]
  jax.tree.map(np.testing.assert_array_equal, final_params(straight), final_params(resumed))


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_sample_continues_prompt(tmp_path):
  cfg = tiny_config(train=dict(steps=2), mesh=dict(data=1))
  cfg.mesh.data = 8
  jaxtrain.train(cfg, str(tmp_path), progress=False, sync_every_step=True)
  text = jaxtrain.sample(str(tmp_path), "< 1 2 3 |", max_new_tokens=5, temperature=0.0, top_k=0)
  tokens = text.split()
  assert 1 <= len(tokens) <= 5 and all(t in "<|>" or t.isdigit() for t in tokens)
  again = jaxtrain.sample(str(tmp_path), "< 1 2 3 |", max_new_tokens=5, temperature=0.0, top_k=0)
  assert again == text  # greedy decoding is deterministic


@pytest.mark.optimized
@pytest.mark.slow
def test_tiny_reaches_entropy_floor(tmp_path):
  cfg = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  final = jaxtrain.train(cfg, str(tmp_path), devices=jax.devices()[:1], progress=False)
  assert final["eval_loss"] < 1.05 * final["eval_entropy_floor"], final


@pytest.mark.slow  # the older `bytes` kind; keeps the default suite under 10 minutes
def test_bytes_corpus_trains_and_samples_text(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(6):
    (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 5)
  cfg = load_config_file(os.path.join(ROOT, "configs", "bytes_tiny.py") + f":{corpus}")
  cfg.train.update(steps=3, batch_size=8, seq_len=32, eval_every=3, eval_batches=1)
  cfg.optim.warmup_steps = 1
  cfg.model.update(max_seq_len=64)
  final = jaxtrain.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1], progress=False)
  assert np.isfinite(final["eval_loss"]) and "entropy_floor" not in final
  text = jaxtrain.sample(str(tmp_path / "run"), "the ", max_new_tokens=8, temperature=1.0, top_k=5)
  assert isinstance(text, str) and len(text.encode()) <= 8


def test_missing_corpus_is_one_line_exit_2(tmp_path, capsys):
  from jaxtrain.__main__ import main
  code = main(["train", f"--config={ROOT}/configs/bytes_tiny.py:{tmp_path}/nope", f"--workdir={tmp_path}/run"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and "nope" in err
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_sample_bad_input_is_one_line_exit_2(tmp_path, capsys):
  from jaxtrain.__main__ import main
  assert main(["sample", f"--workdir={tmp_path}/none", "--prompt=< 1 |"]) == 2
  assert main(["sample", f"--workdir={tmp_path}", "--bogus=1"]) == 2
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 2 and all(e.startswith("error: ") for e in errors), errors


def test_a_failed_set_up_leaks_no_thread_file_or_manager(tmp_path):
  """Runs that fail after the metrics writer and the checkpoint managers were opened (init_from a
  directory without checkpoints) leave no TensorBoard thread, event file or Orbax thread behind."""
  import threading
  cfg = tiny_config(train=dict(steps=2), checkpoint=dict(init_from=str(tmp_path / "nothing")))
  (tmp_path / "nothing").mkdir()

  def open_files():
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}

  def attempt():
    with pytest.raises(ConfigError, match="init_from"):
      jaxtrain.train(cfg, str(tmp_path / "run"), progress=False, sync_every_step=True)

  attempt()  # the first one loads whatever a first run loads once (thread pools)
  threads, files = set(threading.enumerate()), open_files()
  for _ in range(2):
    attempt()
  # the threads these runs started and left alive (a count also drops when an earlier test's thread ends)
  assert set(threading.enumerate()) - threads == set()
  leaked = {f for f in open_files() - files if str(tmp_path) in f}
  assert not leaked, leaked


def test_progress_bar_is_rate_limited(tmp_path, capfd):
  """log_every=1 must not redraw the bar on every step (a notebook keeps every redraw as a line)."""
  import time
  cfg = tiny_config(train=dict(steps=60, log_every=1), mesh=dict(data=1))
  start = time.perf_counter()
  jaxtrain.train(cfg, str(tmp_path), devices=jax.devices()[:1], progress=True)
  seconds = time.perf_counter() - start
  redraws = capfd.readouterr().err.count("\r")
  assert 1 <= redraws <= seconds / loop.PROGRESS_INTERVAL_S + 3 and redraws < 60, (redraws, seconds)
