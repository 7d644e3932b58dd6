"""Task evaluation inside the training loop (eval.tasks, jaxtrain/eval/loop.py): rows at the due
steps with the numbers jaxtrain.evaluate gives for the saved checkpoint, their time in goodput's
eval badput, a resumed run that does not evaluate a step it logged again, and a bad eval config
refused in one line."""

import os
import shutil

import jax
import pytest

import jaxtrain
from jaxtrain import config as config_lib
from jaxtrain.metrics import read_metrics
from jaxtrain.plotting import curves, series
from tests.eval.conftest import write_jsonl
from tests.fixtures import tiny_config


def byte_config(tmp_path, **eval_section):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the fox ran to the river and drank.\n" * 40)
  mc = write_jsonl(tmp_path / "mc.jsonl", [
      {"context": "the fox ran to the", "choices": ["river", "fox", "sea"], "gold": 0},
      {"context": "the fox", "choices": ["ran", "drank water"], "gold": 0},
      {"context": "and", "choices": ["drank", "the"], "gold": 0}])
  ppl = write_jsonl(tmp_path / "wiki.jsonl", [{"text": "the fox ran"},
                                              {"text": "to the river bank"}])
  return tiny_config(model={"vocab_size": 260}, data={"kind": "bytes", "path": str(corpus)},
                     train={"steps": 4, "eval_every": 0}, mesh={"data": 1},
                     checkpoint={"every_steps": 2},
                     eval={"tasks": f"{mc},{ppl}", "every_steps": 2, **eval_section}), [mc, ppl]


def eval_rows(workdir):
  return [r for r in read_metrics(workdir) if any(k.startswith("eval/") for k in r)]


def train(cfg, workdir):
  return jaxtrain.train(cfg, workdir, devices=jax.devices()[:1], progress=False,
                        sync_every_step=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 4-step byte run evaluating two tasks every 2 steps (the first 2 docs, one-shot), checkpoints
  at steps 2 and 4."""
  tmp_path = tmp_path_factory.mktemp("loop")
  cfg, paths = byte_config(tmp_path, limit=2, num_fewshot=1, seed=3)
  workdir = str(tmp_path / "run")
  final = train(cfg, workdir)
  return cfg, paths, workdir, final


def test_rows_at_the_due_steps_equal_evaluate_of_the_checkpoint(trained):
  _, paths, workdir, final = trained
  rows = eval_rows(workdir)
  assert [r["step"] for r in rows] == [2, 4]
  # the newest checkpoint: step 4
  want = jaxtrain.evaluate(workdir, paths, num_fewshot=1, seed=3, limit=2)
  got = {k: v for k, v in rows[-1].items() if k.startswith("eval/") and k != "eval/time_s"}
  assert got == pytest.approx({f"eval/{t}/{m}": v for t, ms in want.items() for m, v in ms.items()},
                              rel=1e-6)
  assert 0 <= got["eval/mc/acc"] <= 1 and 0 < got["eval/wiki/bits_per_byte"] < 20
  assert got["eval/mc/docs"] == 2
  # the evaluations' time is in goodput's eval badput (no eval loss runs: train.eval_every=0)
  times = sum(r["eval/time_s"] for r in rows)
  assert 0 < times <= final["badput_eval_s"] + 1e-6
  assert "eval_loss" not in final
  # jaxtrain.plot draws them (TensorBoard gets the same scalars from the writer)
  assert series(curves(workdir).rows, "eval/mc/acc_norm")[0] == [2, 4]
  pytest.importorskip("matplotlib").use("Agg")
  fig = jaxtrain.plot(workdir, keys=("eval/mc/acc", "eval/wiki/bits_per_byte"))
  assert len(fig.axes) == 2 and all(ax.lines for ax in fig.axes)


def test_a_resumed_run_does_not_repeat_a_logged_evaluation(trained, tmp_path):
  """The step-4 checkpoint lost (a crash after its row was logged): the rerun resumes from step 2
  and recomputes steps 3 and 4, but not step 4's evaluation."""
  cfg, _, workdir, _ = trained
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  shutil.rmtree(os.path.join(copy, "checkpoints", "4"))
  train(cfg, copy)
  steps = [r["step"] for r in read_metrics(copy) if "event" not in r and "loss" in r]
  assert steps.count(4) == 2  # step 4 trained twice
  assert [r["step"] for r in eval_rows(copy)] == [2, 4]  # evaluated once


@pytest.mark.parametrize("section, message", [
    ({"tasks": "missing.jsonl"}, "eval.tasks: no such task file: missing.jsonl"),
    ({"every_steps": -1}, "eval.every_steps must be an integer >= 0, got -1"),
])
def test_a_bad_eval_config_is_one_line(tmp_path, section, message):
  cfg, _ = byte_config(tmp_path)
  cfg.eval.update(section)
  with pytest.raises(config_lib.ConfigError, match="^" + message.replace(".", r"\.") + "$"):
    config_lib.validate(cfg, 1)


def test_a_bad_task_file_stops_the_run_at_startup_in_one_line(tmp_path):
  cfg, (mc, _) = byte_config(tmp_path)
  with open(mc, "a") as f:
    f.write('{"context": "Q:", "choices": [], "gold": 0}\n')
  with pytest.raises(config_lib.ConfigError) as e:
    train(cfg, str(tmp_path / "run"))
  assert "mc.jsonl:4: multiple_choice: 'choices' must be a non-empty" in str(e.value)
  assert "\n" not in str(e.value)
  assert not os.listdir(tmp_path / "run" / "checkpoints")  # before the first step
