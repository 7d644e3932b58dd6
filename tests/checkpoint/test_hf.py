"""HF Llama import/export against transformers' own LlamaForCausalLM, logits to 1e-4."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tokenizers  # noqa: E402

from jaxtrain import __main__ as cli  # noqa: E402
from jaxtrain.checkpoint import hf, pretrained  # noqa: E402

torch.set_grad_enabled(False)
TEXTS = ["Once upon a time there was a little fox.", "The fox lived in a forest near a river.",
         "Every day the fox ran to the river to drink.", "One day it met a bear who was fishing."] * 5


def bpe_tokenizer_json(path):
  """A byte-level BPE tokenizer.json as HF Llama-3-style models ship them, trained here on TEXTS."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(
      vocab_size=300, show_progress=False, special_tokens=["<s>", "</s>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path))
  return tok.token_to_id("<s>"), tok.token_to_id("</s>")


def hf_model(tie: bool, seed: int = 0, **config):
  """A tiny random float32 Llama (`config` overrides LlamaConfig fields); every weight (norms included)
  is perturbed so a swapped or mis-transposed tensor changes the logits."""
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(**{
      "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64, "rope_theta": 12345.0,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": tie, "attn_implementation": "eager", **config})
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


@pytest.mark.parametrize("tie, head_dim", [(False, 16), (True, 16), (False, 8)])  # 8: not hidden_size / heads
def test_import_matches_transformers_and_export_round_trips(tmp_path, tokens_BL, tie, head_dim):
  model = hf_model(tie, head_dim=head_dim)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  want = hf_logits(model, tokens_BL)

  cfg, params, apply_fn = pretrained.load_pretrained(str(tmp_path / "hf"))
  assert (cfg.rope_theta, cfg.tie_embeddings, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps) == (12345.0, tie, 2, head_dim,
                                                                                         1e-5)
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


BASE = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 96}


@pytest.mark.parametrize("change, named", [
    ({"model_type": "granite"}, "model_type 'granite' is not supported (llama, mixtral)"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"model_type": None}, "model_type None is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
     "rope_parameters"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"sliding_window": 32, "max_position_embeddings": 64}, "sliding_window=32"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"hidden_size": 66}, "hidden_size=66 is not a multiple of num_attention_heads=4"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"hidden_size": "64"}, "hidden_size='64'"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0"),
    ({"vocab_size": True}, "vocab_size=True"),
    ({"intermediate_size": 0}, "intermediate_size=0"),
    ({"head_dim": -16}, "head_dim=-16"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5'"),
    ({"rope_theta": float("nan")}, "rope_theta=nan"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear'"),
    ({"hidden_act": 3}, "hidden_act=3 is not a string"),
])
def test_config_refuses_unsupported_settings_with_one_line_naming_them(change, named):
  assert hf.config_from_hf(BASE).n_kv_heads == 4
  with pytest.raises(ValueError) as e:
    hf.config_from_hf({**BASE, **change})
  assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("config", [[BASE], "llama", None, {k: v for k, v in BASE.items() if k != "hidden_size"}])
def test_config_that_is_no_object_or_lacks_a_key_is_one_line(config):
  with pytest.raises(ValueError) as e:
    hf.config_from_hf(config)
  assert "\n" not in str(e.value) and ("JSON object" in str(e.value) or "lacks hidden_size" in str(e.value))


def test_granite_is_refused_by_the_cli_and_load_pretrained(tmp_path, capsys):
  """Granite stores Llama's tensor names but scales embeddings, residuals, attention and logits: it
  converted with exit 0 and logits off by several units."""
  torch.manual_seed(0)
  config = transformers.GraniteConfig(
      vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=96, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22,
      attention_multiplier=0.0078125, logits_scaling=8.0)
  transformers.GraniteForCausalLM(config).float().eval().save_pretrained(tmp_path / "hf", safe_serialization=True)
  capsys.readouterr()  # save_pretrained's progress bar
  rc = cli.main(["convert", "--from_hf", str(tmp_path / "hf"), "--to", str(tmp_path / "wd")])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and err.count("\n") == 1, err
  assert err.startswith("error: ") and "model_type 'granite' is not supported (llama, mixtral)" in err
  assert not os.path.exists(tmp_path / "wd")
  with pytest.raises(ValueError, match="model_type 'granite' is not supported"):
    pretrained.load_pretrained(str(tmp_path / "hf"))
