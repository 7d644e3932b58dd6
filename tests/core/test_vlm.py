"""Image-text training (train.task=vlm): the checks refuse what it cannot train in one line, the
generated shapes rows are deterministic and score the answer only, a frozen encoder does not
change while the rest trains, and vlm_tiny answers about held-out images far above the same model
trained blind (images zeroed), which stays near chance (1/4)."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import builder, config as config_lib, metrics, parallel
from jaxtrain.checkpoint import pretrained
from jaxtrain.config_files import load_config_file
from jaxtrain.core import state as state_lib
from jaxtrain.core.vlm import VisionLanguage
from jaxtrain.data import shapes
from tests.fixtures import ROOT, tiny_config


def vlm_config(**sections):
  c = tiny_config(**sections)
  c.model.vision.update(image_size=8, patch_size=4, d_model=16, n_layers=1, n_heads=2)
  c.train.update(task="vlm", seq_len=8)
  return c


@pytest.mark.parametrize("change, message", [
    ({"vision": {"patch_size": 3}}, "model.vision.image_size=8 is not divisible by"),
    ({"vision": {"n_heads": 3}}, "model.vision.d_model=16 is not divisible by"),
    ({"vision": {"image_token": 64}}, "model.vision.image_token=64 is not in the vocabulary"),
    ({"vision": {"n_layers": 0}}, "model.vision.n_layers must be positive"),
    ({"model": {"n_experts": 4}}, "runs a dense decoder"),
    ({"train": {"cross_entropy": "chunked"}}, "computes its logits in full"),
    ({"eval": {"tasks": "a.jsonl"}}, "eval.tasks score text alone"),
])
def test_what_vlm_cannot_train_is_refused_in_one_line(change, message):
  cfg = vlm_config()
  for section, values in change.items():
    (cfg.model.vision if section == "vision" else cfg[section]).update(values)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    ({"vision": {"image_token": 5}}, "is an id the shapes data emits"),
    ({"train": {"seq_len": 5}}, "is shorter than a row.s image: 6 tokens"),
])
def test_what_the_shapes_data_cannot_hold_is_refused_at_build(change, message):
  cfg = vlm_config()
  for section, values in change.items():
    (cfg.model.vision if section == "vision" else cfg[section]).update(values)
  config_lib.validate(cfg, 8)
  with pytest.raises(config_lib.ConfigError, match=message):
    builder.make_task(cfg, "")


def test_shapes_rows_are_deterministic_held_out_and_score_the_answer_only():
  task = VisionLanguage(vlm_config(), "")
  it = task.batches("train", 2, 6)
  first, second = next(it), next(it)
  state = it.get_state()
  again = task.batches("train", 0, 8)
  next(again)
  np.testing.assert_array_equal(next(again)["images"][2:6], second["images"])  # rows 2:6 of batch 1
  it.set_state({"index": 1})
  np.testing.assert_array_equal(next(it)["inputs"], second["inputs"])
  assert state == {"index": 2}
  held_out = next(task.batches("eval", 2, 6))
  assert not np.allclose(held_out["images"], first["images"])
  b = first
  assert b["images"].shape == (4, 1, 8, 8, 3) and b["images"].dtype == np.float32
  assert b["images"].min() >= -1 and b["images"].max() <= 1
  np.testing.assert_array_equal(b["loss_mask"].sum(axis=1), 1)  # one answer a row
  answers = b["targets"][b["loss_mask"] > 0]
  assert ((answers >= shapes.FIRST_SHAPE) & (answers < shapes.VOCAB)).all()
  np.testing.assert_array_equal((b["inputs"] == 63).sum(axis=1), 4)  # 4 patches, image_token -1
  asked = b["inputs"][b["loss_mask"] > 0]  # the question is the answer's input
  assert ((asked == shapes.ASK_COLOUR) == (answers >= shapes.FIRST_COLOUR)).all()


def test_placeholders_and_padding_are_never_scored():
  cfg = vlm_config()
  task = VisionLanguage(cfg, "")
  batch = next(task.batches("train", 0, 8))
  batch["loss_mask"] = np.ones_like(batch["loss_mask"])  # a mask that asks for every target
  params, extra, task_state = nn.unbox(jax.jit(task.init)(jax.random.key(0)))
  _, sums = jax.jit(task.loss)(params, batch, extra, task_state)
  text = (batch["targets"] != 63) & (batch["segment_ids"] > 0)
  assert int(sums["count"]) == int(text.sum()) == 8 * 2  # the question and the answer a row


def test_a_frozen_encoder_does_not_change_while_the_rest_trains(tmp_path):
  cfg = vlm_config(mesh={"data": 2, "fsdp": -1})
  cfg.model.vision.freeze = True
  config_lib.validate(cfg, 8)
  run = builder.build(cfg, str(tmp_path))
  state, shardings = state_lib.create_state(run.task, run.tx, 0, run.mesh, cfg.mesh.rules)
  assert set(state.params) == {"projector", "decoder"} and set(state.task_state) == {"vision"}
  before = jax.tree.map(np.asarray, (state.params, state.task_state))
  feed = parallel.Feed(run.task.batch_size, parallel.batch_sharding(run.mesh))
  batches = run.task.batches("train", feed.lo, feed.hi)
  with parallel.activate(run.mesh, cfg.mesh.rules):
    train_fn, _ = builder.compile_steps(cfg, *run, shardings)
    for _ in range(2):
      state, _ = train_fn(state, feed.put(next(batches)))
  after = jax.tree.map(np.asarray, (state.params, state.task_state))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[1]),
                                                  jax.tree.leaves(after[1])))
  assert not np.array_equal(before[0]["projector"]["up"], after[0]["projector"]["up"])


@pytest.mark.slow  # a 1-step run and a restore
def test_a_frozen_encoder_is_read_from_init_from(tmp_path):
  base = str(tmp_path / "base")
  jaxtrain.train(vlm_config(train={"steps": 1}), base, devices=jax.devices()[:1], progress=False)
  cfg = vlm_config(checkpoint={"init_from": base})
  cfg.model.vision.freeze = True
  run = builder.build(cfg, str(tmp_path / "frozen"), devices=jax.devices()[:1])
  state, _ = state_lib.create_state(run.task, run.tx, 1, run.mesh, cfg.mesh.rules)
  load = lambda like, step=None: builder.init_params(base, like, step)  # noqa: E731
  params, task_state = run.task.init_from(state.params, state.task_state, load)
  _, saved = pretrained.load_params(base)
  for got, part in ((task_state["vision"], "vision"), (params["projector"], "projector")):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(saved[part])):
      np.testing.assert_array_equal(np.asarray(x), y)


def test_a_frozen_vlm_run_resumes_bitwise(tmp_path):
  """Checkpoint at step 3 of 6, rerun from there: the same losses and params (the shapes rows come
  by index; the frozen encoder, in the task state, travels through the checkpoint, or the losses
  would differ)."""
  cfg = vlm_config(train={"steps": 6}, checkpoint={"every_steps": 3})
  cfg.model.vision.freeze = True
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  devices = jax.devices()[:1]
  jaxtrain.train(cfg, straight, devices=devices, progress=False)
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, devices=devices, progress=False)
  losses = lambda d: [r["loss"] for r in metrics.read_metrics(d) if "loss" in r]  # noqa: E731
  assert losses(resumed) == losses(straight)[3:] and len(losses(resumed)) == 3
  (_, a), (_, b) = pretrained.load_params(straight), pretrained.load_params(resumed)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def save_png(pixels, path) -> str:
  """A normalized image ([H, W, 3] in [-1, 1]) as an 8-bit PNG."""
  from PIL import Image
  Image.fromarray(np.round((pixels + 1) / 2 * 255).astype(np.uint8)).save(path)
  return str(path)


def test_sample_answers_about_an_image_as_the_model_does(tmp_path):
  """`sample --image` on a frozen-encoder run (its encoder read from the task state) gives the
  decoder's own argmax at the question for the same pixels, in a forward pass of the whole model
  written out here; what sample cannot answer, and an export to HF, are refused in one line."""
  from jaxtrain.data import image_text
  from jaxtrain.model import ModelConfig
  from jaxtrain.model.vision import VisionLanguageModel
  cfg = vlm_config(train={"steps": 2})
  cfg.model.vision.freeze = True
  run = str(tmp_path / "run")
  jaxtrain.train(cfg, run, devices=jax.devices()[:1], progress=False)
  _, image = shapes.example(0, "eval", 0, 8, 4, 63)
  png = save_png(image, tmp_path / "shape.png")
  saved, params, _ = pretrained.read_step(run)
  params = {**params, **pretrained.load_task_state(run, key="vision")}
  assert set(params) == {"vision", "projector", "decoder"}
  v = config_lib.VisionConfig.from_config(saved.model.vision)
  model = VisionLanguageModel(ModelConfig.from_config(saved.model), dataclasses.replace(v, image_token=63))
  pixels = image_text.load_image(png, 8, 3)
  for question, ask in (("shape?", shapes.ASK_SHAPE), ("colour?", shapes.ASK_COLOUR)):
    tokens = np.asarray([[shapes.BOS] + [63] * 4 + [ask]], np.int32)
    logits = model.apply({"params": params}, tokens, pixels[None, None])
    want = shapes.ShapesTokenizer().decode([int(np.argmax(logits[0, -1]))])
    assert jaxtrain.sample(run, question, 5, 0.0, 0, image=png) == want
  assert jaxtrain.sample(run, None, 1, 0.0, 0, image=png) == jaxtrain.sample(run, "shape?", 1, 0.0, 0,
                                                                             image=png)
  for args, message in (((None, 1, 0.0, 0), "a vlm run answers about an image: pass --image"),
                        (("size?", 1, 0.0, 0), "the shapes data asks 'shape?' or 'colour?', not 'size?'")):
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
      jaxtrain.sample(run, *args, image=None if message.startswith("a vlm") else png)
  (tmp_path / "note.png").write_text("not an image")
  with pytest.raises(config_lib.ConfigError, match="note.png: not an image"):
    jaxtrain.sample(run, "shape?", 1, 0.0, 0, image=str(tmp_path / "note.png"))
  from jaxtrain.checkpoint import convert
  with pytest.raises(config_lib.ConfigError, match="is a vlm run .* export to a Hugging Face"):
    convert.to_hf(run, str(tmp_path / "hf"))


class Blinded:
  """A task's batches with every image zeroed: what the text alone tells."""

  def __init__(self, inner):
    self.inner = inner

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self.inner)
    return {**batch, "images": np.zeros_like(batch["images"])}

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


class Blind(VisionLanguage):
  def batches(self, split, lo, hi):
    return Blinded(super().batches(split, lo, hi))


@pytest.mark.slow  # convergence: two 800-step runs, ~30 s each on 2 cores
@pytest.mark.long  # 210 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_vlm_tiny_answers_from_the_image_and_blind_stays_at_chance(tmp_path):
  """Held-out accuracy (256 eval rows) with images far above chance (1/4: four answers to each
  question, uniform), the same model trained on zeroed images near it. Measured: README."""
  cfg = load_config_file(os.path.join(ROOT, "configs", "vlm_tiny.py"))
  seeing = jaxtrain.train(cfg, str(tmp_path / "seeing"), devices=jax.devices()[:1], progress=False)
  blind = jaxtrain.train(cfg, str(tmp_path / "blind"), task=Blind(cfg, str(tmp_path / "blind")),
                         devices=jax.devices()[:1], progress=False)
  print(f"vlm_tiny held-out accuracy: {seeing['eval_accuracy']:.3f} with images, "
        f"{blind['eval_accuracy']:.3f} blind, chance {shapes.CHANCE}")
  assert seeing["eval_accuracy"] > 0.8, seeing
  assert abs(blind["eval_accuracy"] - shapes.CHANCE) < 0.1, blind
  # the held-out questions again, each image through a PNG file and `sample --image`
  right, n = 0, 24
  for i in range(n):
    tokens, image = shapes.example(cfg.train.seed, "eval", i, 16, 16, 63)
    png = save_png(image, tmp_path / f"{i}.png")
    question = "colour?" if tokens[-2] == shapes.ASK_COLOUR else "shape?"
    answer = jaxtrain.sample(str(tmp_path / "seeing"), question, 1, 0.0, 0, image=png)
    right += answer == shapes.ShapesTokenizer().decode([tokens[-1]])
  print(f"sample --image: {right}/{n} held-out answers right")
  assert right >= 0.75 * n, (right, n)
  done = subprocess.run([sys.executable, "-m", "jaxtrain", "sample", "--workdir", str(tmp_path / "seeing"),
                         "--image", png, "--prompt", question], capture_output=True, text=True, cwd=ROOT)
  assert done.returncode == 0 and done.stdout.strip() in shapes.ANSWERS, done.stderr[-2000:]
  from jaxtrain.eval import harness
  with pytest.raises(config_lib.ConfigError, match="evaluate scores text alone"):
    harness.evaluate(str(tmp_path / "seeing"), [])


def test_plan_says_what_its_prediction_leaves_out_for_a_vlm(capsys):
  from jaxtrain.__main__ import main
  from jaxtrain.model.vision import vision_param_count
  assert main(["plan", "--config", os.path.join(ROOT, "configs", "vlm_tiny.py")]) == 0
  cfg = load_config_file(os.path.join(ROOT, "configs", "vlm_tiny.py"))
  n = vision_param_count(config_lib.ModelConfig.from_config(cfg.model),
                         config_lib.VisionConfig.from_config(cfg.model.vision))
  assert f"the image encoder and projector ({n:,} parameters)" in capsys.readouterr().out
