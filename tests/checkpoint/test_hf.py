"""HF Llama import/export against transformers' own LlamaForCausalLM, logits to 1e-4."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtrain.checkpoint import hf, pretrained  # noqa: E402

torch.set_grad_enabled(False)


def hf_model(tie: bool, seed: int = 0):
  """A tiny random float32 Llama; every weight (norms included) is perturbed so a swapped or
  mis-transposed tensor changes the logits."""
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=96, max_position_embeddings=64, rope_theta=12345.0, rms_norm_eps=1e-5,
      tie_word_embeddings=tie, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(config).float().eval()
  for p in model.parameters():
    p.copy_(p + 0.1 * torch.randn_like(p))
  return model


def hf_logits(model, tokens_BL):
  return model(torch.from_numpy(tokens_BL).long()).logits.numpy()


def from_pretrained(path):
  return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


@pytest.fixture
def tokens_BL():
  return np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)


@pytest.mark.parametrize("tie", [False, True])
def test_import_matches_transformers_and_export_round_trips(tmp_path, tokens_BL, tie):
  model = hf_model(tie)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  want = hf_logits(model, tokens_BL)

  cfg, params, apply_fn = pretrained.load_pretrained(str(tmp_path / "hf"))
  assert (cfg.rope_theta, cfg.tie_embeddings, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps) == (12345.0, tie, 2, 16, 1e-5)
  assert ("unembed" in params) == (not tie)
  got = np.asarray(apply_fn(params, tokens_BL))
  assert np.abs(got - want).max() < 1e-4

  hf.export_hf(cfg, params, str(tmp_path / "out"))
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
  assert np.abs(hf_logits(from_pretrained(tmp_path / "out"), tokens_BL) - want).max() < 1e-4


def test_sharded_export_loads_in_transformers_and_back(tmp_path, tokens_BL):
  model = hf_model(tie=False, seed=1)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  cfg, params = hf.import_hf(str(tmp_path / "hf"))
  hf.export_hf(cfg, params, str(tmp_path / "out"), max_shard_bytes=60_000)

  with open(tmp_path / "out" / "model.safetensors.index.json") as f:
    shards = set(json.load(f)["weight_map"].values())
  assert len(shards) > 2 and shards <= set(os.listdir(tmp_path / "out"))
  want = hf_logits(model, tokens_BL)
  assert np.abs(hf_logits(from_pretrained(tmp_path / "out"), tokens_BL) - want).max() < 1e-4
  cfg2, params2 = hf.import_hf(str(tmp_path / "out"))
  assert cfg2 == cfg
  for path in [("embed",), ("unembed",), ("layers", "attn", "q"), ("layers", "attn", "o"), ("layers", "mlp", "down")]:
    np.testing.assert_array_equal(hf.get_at(params2, path), hf.get_at(params, path))


def test_bfloat16_checkpoint_imports_exactly(tmp_path):
  model = hf_model(tie=False).to(torch.bfloat16)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  _, params = hf.import_hf(str(tmp_path / "hf"))
  q = model.model.layers[1].self_attn.q_proj.weight.float().numpy()  # [H*K, D]
  np.testing.assert_array_equal(params["layers"]["attn"]["q"][1], q.T.reshape(64, 4, 16))
  np.testing.assert_array_equal(params["embed"], model.model.embed_tokens.weight.float().numpy())


@pytest.mark.parametrize("change", [{"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
                                    {"attention_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"}])
def test_config_refuses_unsupported_features(change):
  base = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 96}
  assert hf.config_from_hf(base).n_kv_heads == 4
  with pytest.raises(ValueError):
    hf.config_from_hf({**base, **change})
