"""BERT interop: a random BertForMaskedLM built with transformers (no download) runs in jaxtrain's
encoder with transformers' masked-token logits (float32, within 1e-4), exports back to a directory
transformers loads with equal logits, and what is not BERT's masked LM is refused in one line."""

import json
import os

import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain.checkpoint import convert, hf_bert, pretrained
from jaxtrain.model import Encoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)


def random_bert(path, **overrides):
  """A random BertForMaskedLM saved at `path` (LayerNorms and biases randomized too, so a wrong
  mapping shows); returns the torch model in eval mode."""
  torch.manual_seed(0)
  model = transformers.BertForMaskedLM(transformers.BertConfig(**{**SMALL, **overrides})).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "LayerNorm" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def batch(seed=1, b=3, length=17, vocab=61):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (b, length)).astype(np.int64)
  types = (np.arange(length) >= length // 2).astype(np.int64) * np.ones((b, 1), np.int64)
  return tokens, types


def torch_logits(model, tokens, types):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(types)).logits.numpy()


def ours(cfg, params, tokens, types):
  return np.asarray(Encoder(cfg).apply({"params": params}, tokens.astype(np.int32), None, None,
                                       types.astype(np.int32)))


def test_bert_logits_equal_transformers_and_export_round_trips(tmp_path):
  model = random_bert(tmp_path / "hf")
  tokens, types = batch()
  want = torch_logits(model, tokens, types)
  cfg, params = hf_bert.import_hf(str(tmp_path / "hf"))
  got = ours(cfg, params, tokens, types)
  assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
  # masked positions: the [MASK]-style fill-in reads exactly these logits
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  hf_bert.export_hf(cfg, params, str(tmp_path / "back"))
  again = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "back")).eval()
  back = torch_logits(again, tokens, types)
  assert np.abs(back - want).max() < 1e-5


def test_convert_from_hf_makes_an_mlm_workdir_and_to_hf_writes_bert_back(tmp_path):
  model = random_bert(tmp_path / "hf")
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
  saved = json.load(open(tmp_path / "run" / "config.json"))
  assert (saved["train"]["task"], saved["model"]["arch"], saved["model"]["positions"]) == \
      ("mlm", "encoder", "learned")
  tokens, types = batch(2, vocab=SMALL["vocab_size"])
  cfg, params, apply_fn = pretrained.load_pretrained(str(tmp_path / "run"))
  want = torch_logits(model, tokens, np.zeros_like(types))
  got = np.asarray(apply_fn(params, tokens.astype(np.int32)))
  assert np.abs(got - want).max() < 1e-4
  convert.to_hf(str(tmp_path / "run"), str(tmp_path / "back"))
  again = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "back")).eval()
  assert np.abs(torch_logits(again, tokens, types) - torch_logits(model, tokens, types)).max() < 1e-5


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
    ({"is_decoder": True}, "is_decoder=True is not supported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ({"architectures": ["BertForSequenceClassification"]}, "only BertForMaskedLM"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 is not a positive integer"),
])
def test_what_is_not_berts_masked_lm_is_refused_in_one_line(tmp_path, change, message):
  random_bert(tmp_path / "hf")
  path = tmp_path / "hf" / "config.json"
  hf = json.load(open(path))
  hf.update(change)
  json.dump(hf, open(path, "w"))
  with pytest.raises(config_lib.ConfigError) as e:
    convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
  assert message in str(e.value) and "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run")


def test_a_missing_tensor_is_refused_before_anything_is_written(tmp_path):
  from safetensors.numpy import load_file, save_file
  random_bert(tmp_path / "hf")
  weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
  del weights["bert.encoder.layer.1.output.dense.bias"]
  save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
  with pytest.raises(config_lib.ConfigError, match="lacks tensor bert.encoder.layer.1.output"):
    convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


def test_export_refuses_an_encoder_bert_cannot_express(tmp_path):
  cfg = hf_bert.ModelConfig(arch="encoder", positions="rope", vocab_size=16, d_model=8, n_layers=1,
                            n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8, max_seq_len=8)
  with pytest.raises(ValueError, match="BERT needs learned positions"):
    hf_bert.config_to_hf(cfg)
  with pytest.raises(ValueError, match="not a decoder"):
    hf_bert.config_to_hf(hf_bert.ModelConfig())
