"""Masked-LM pre-training (train.task=mlm): bert_base has BERT-base's parameters, the task's checks
refuse what it cannot train in one line, and mlm_tiny trains to its target on CPU and fills in
masked tokens."""

import os

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import builder, config as config_lib
from jaxtrain.config_files import load_config_file
from jaxtrain.core import state as state_lib
from jaxtrain.model import param_count
from tests.fixtures import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mlm_config(**sections):
  c = tiny_config(**sections)
  c.model.update(arch="encoder", positions="learned")
  c.train.task = "mlm"
  return c


def test_bert_base_builds_abstractly_with_berts_parameter_count():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = load_config_file(os.path.join(ROOT, "configs", "bert_base.py"))
  config_lib.validate(cfg, jax.device_count())
  _, task, tx, _ = builder.build(cfg)
  abstract = state_lib.abstract_state(task, tx)  # eval_shape: nothing allocated
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
  with torch.device("meta"):
    bert = transformers.BertForMaskedLM(transformers.BertConfig())
  # HF counts the tied decoder weight once and its bias (tied to cls.predictions.bias) once
  assert n == param_count(task.model.cfg) == sum(p.numel() for p in bert.parameters())
  assert 109e6 < n < 111e6, n


@pytest.mark.parametrize("change, message", [
    ({"train": {"task": "lm"}}, "masked-LM pre-training (mlm) trains the encoder"),
    ({"model": {"arch": "decoder", "positions": "rope"}}, "trains the encoder"),
    ({"model": {"n_experts": 4}}, "model.n_experts=4 is the decoder's"),
    ({"model": {"attention": "pallas"}}, "the encoder runs auto, xla, blockwise"),
    ({"train": {"cross_entropy": "chunked"}}, "computes its logits in full"),
    ({"train": {"mask_prob": 1.0}}, "train.mask_prob must be in (0, 1)"),
    ({"train": {"mask_token": 64}}, "train.mask_token=64 is not in the vocabulary"),
    ({"mesh": {"data": 1, "context": 2, "fsdp": -1}}, "without pipeline stages or context"),
])
def test_what_mlm_cannot_train_is_refused_in_one_line(change, message):
  cfg = mlm_config()
  for section, values in change.items():
    cfg[section].update(values)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_the_decoder_keeps_rotary_positions():
  cfg = tiny_config(model={"positions": "learned"})
  with pytest.raises(config_lib.ConfigError, match="the decoder has rotary positions only"):
    config_lib.validate(cfg, 8)


def test_a_mask_token_the_data_emits_is_refused():
  cfg = mlm_config(model={"vocab_size": 44})  # synthetic: 4 + 40 symbols = ids 0..43
  config_lib.validate(cfg, 8)
  with pytest.raises(config_lib.ConfigError, match="is an id the synthetic data emits"):
    builder.make_task(cfg, "")


@pytest.mark.slow
@pytest.mark.long  # 92 s in CI's compute phase (2-core EPYC, 2026-12-07): `make test-long`
def test_mlm_tiny_trains_to_its_target_and_fills_in_masks(tmp_path):
  """mlm_tiny's masked-token eval loss within 1.3x of eval_mlm_bound, the informed predictor's loss
  on the same tokens (a lower bound on any model's; measured: configs/mlm_tiny.py), and the filled-in
  symbols are their copies'."""
  cfg = load_config_file(os.path.join(ROOT, "configs", "mlm_tiny.py"))
  final = jaxtrain.train(cfg, str(tmp_path), devices=jax.devices()[:1], progress=False)
  assert final["eval_loss"] < 1.3 * final["eval_mlm_bound"], final
  assert final["eval_accuracy"] > 0.8, final
  text = jaxtrain.sample(str(tmp_path), "< 17 4 99 120 3 [MASK] 8 150 42 77 19 63 | 17 4 [MASK] 120 "
                         "3 56 8 150 42 [MASK] 19 63 >", 1, 0.0, 0)
  assert text == ("< 17 4 99 120 3 56 8 150 42 77 19 63 | 17 4 99 120 3 56 8 150 42 77 19 63 >")
  with pytest.raises(config_lib.ConfigError, match="fills in \\[MASK\\] markers"):
    jaxtrain.sample(str(tmp_path), "< 1 2 |", 1, 0.0, 0)
  from jaxtrain.eval import harness
  with pytest.raises(config_lib.ConfigError, match="masked-LM encoder"):
    harness.evaluate(str(tmp_path), [])
