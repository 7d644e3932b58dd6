"""SFT: the loss and its gradient ignore prompt tokens and follow completion tokens; a tiny run trains
through jaxtrain.train, evaluates on the held-out split, and resumes bitwise."""

import os
import shutil

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import checkpoint, config_files, metrics
from jaxtrain.posttrain import Sft, data
from jaxtrain import builder
from tests.fixtures import ROOT, tiny_config


def sft_config(**train):
  return tiny_config(data=dict(symbols=40), train=dict(task="sft", seq_len=32, batch_size=8, **train),
                     posttrain=dict(synthetic_examples=200))


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_prompt_targets_change_nothing_completion_targets_do(tmp_path):
  cfg = sft_config()
  task = Sft(cfg, str(tmp_path))
  params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, task.init(jax.random.key(0))[0],
                        is_leaf=lambda x: hasattr(x, "names"))
  batch = next(task.batches("train", 0, 8))
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: task.loss(p, b, {}, {})[0]))
  loss, grad = value_and_grad(params, batch)
  prompt = np.argwhere((batch["loss_mask"] == 0) & (batch["segment_ids"] > 0))
  completion = np.argwhere(batch["loss_mask"] == 1)
  assert len(prompt) > 10 and len(completion) > 10
  changed = {k: v.copy() for k, v in batch.items()}
  for r, c in prompt:
    changed["targets"][r, c] = (changed["targets"][r, c] + 7) % cfg.model.vocab_size
  loss2, grad2 = value_and_grad(params, changed)
  assert float(loss2) == float(loss)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad2)))
  changed = {k: v.copy() for k, v in batch.items()}
  r, c = completion[3]
  changed["targets"][r, c] = (changed["targets"][r, c] + 7) % cfg.model.vocab_size
  loss3, grad3 = value_and_grad(params, changed)
  assert float(loss3) != float(loss)
  assert not np.array_equal(jax.tree.leaves(grad)[0], jax.tree.leaves(grad3)[0])
  # the loss is the summed cross-entropy of exactly the completion targets (an independent log-softmax)
  logits = task.model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64))
  want = -sum(float(logp[r, c, batch["targets"][r, c]]) for r, c in completion)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def final_params(cfg, workdir):
  mesh, task, tx, _ = builder.build(cfg, workdir)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, read_only=True)
  state = builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.slow  # two runs; keeps the default suite under 10 minutes
def test_sft_trains_evaluates_and_resumes_bitwise(tmp_path):
  cfg = sft_config(steps=12, eval_every=6, eval_batches=2)
  cfg.checkpoint.every_steps = 6
  cfg.optim.update(lr=1e-2, warmup_steps=2)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  final = jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(straight) if "loss" in r]
  # from log(vocab) at init to below log(symbols): it has learned at least which tokens complete a prompt
  assert abs(rows[0]["loss"] - np.log(64)) < 0.1 and rows[-1]["loss"] < np.log(40), rows
  assert 0 <= final["eval_accuracy"] <= 1 and [r["step"] for r in rows if "eval_loss" in r] == [6, 12]
  assert final["train_examples"] == 180 and final["eval_examples"] == 20 and final["train_skipped"] == 0
  # a run stopped after step 6: drop what came later, rerun the same command, compare
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "12"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[6:]]
  a, b = final_params(cfg, straight), final_params(cfg, resumed)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))


def run_config(name: str, workdir: str, steps: int = 3) -> tuple[dict, list]:
  """configs/NAME.py for a few steps on its own synthetic data (as `python -m jaxtrain train` runs it)."""
  cfg = config_files.apply_overrides(config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py")), {
      "train.steps": str(steps), "train.log_every": "1", "train.eval_every": str(steps), "train.eval_batches": "1",
      "optim.warmup_steps": "1", "posttrain.synthetic_examples": "100"})
  final = jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  return final, [r for r in metrics.read_metrics(workdir) if "loss" in r]


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_sft_tiny_config_trains(tmp_path):
  final, rows = run_config("sft_tiny", str(tmp_path))
  assert len(rows) == 3 and abs(rows[0]["loss"] - np.log(64)) < 0.1 and rows[-1]["loss"] < rows[0]["loss"]
  assert final["train_examples"] == 90 and "eval_accuracy" in final
  assert os.path.isfile(os.path.join(str(tmp_path), data.SYNTHETIC_DIR, "sft.jsonl"))


def test_train_task_picks_the_task_and_bad_values_are_one_line(tmp_path):
  from jaxtrain.config import ConfigError, validate
  from jaxtrain.posttrain import Dpo, RewardModel
  from jaxtrain.core.lm import LanguageModel
  kinds = {"lm": LanguageModel, "sft": Sft, "rm": RewardModel, "dpo": Dpo}
  for name, kind in kinds.items():
    assert type(builder.make_task(tiny_config(train=dict(task=name)), str(tmp_path))) is kind
  choices = r"train.task='sftt': choose one of lm, mlm, vlm, sft, rm, dpo, grpo, ppo"  # builder.TASKS
  with pytest.raises(ConfigError, match=choices):
    builder.make_task(tiny_config(train=dict(task="sftt")), str(tmp_path))
  for key, value, match in (("posttrain.loss", "kto", "posttrain.loss: unknown value"),
                            ("posttrain.beta", 0.0, "posttrain.beta must be in"),
                            ("posttrain.label_smoothing", 0.7, "posttrain.label_smoothing must be in"),
                            ("posttrain.prompt_field", "", "posttrain.prompt_field must name")):
    cfg = tiny_config(train=dict(task="dpo"))
    section, field = key.split(".")
    cfg[section][field] = value
    try:
      validate(cfg, 8)
      raise AssertionError(f"{key}={value!r} was accepted")
    except ConfigError as e:
      assert match in str(e) and "\n" not in str(e)
