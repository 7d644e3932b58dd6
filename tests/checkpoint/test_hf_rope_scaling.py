"""Rope scaling (linear, llama3, yarn) against transformers: the inverse frequencies of its ROPE_INIT_FUNCTIONS,
and Llama logits to 1e-4 at positions past original_max_position_embeddings, HF -> jaxtrain and jaxtrain -> HF."""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain.checkpoint import hf, pretrained  # noqa: E402
from jaxtrain.model import layers  # noqa: E402
from tests.checkpoint.test_hf import BASE, from_pretrained, hf_logits, hf_model  # noqa: E402
from tests.checkpoint.test_hf_mixtral import MIXTRAL  # noqa: E402
from tests.fixtures import tiny_config  # noqa: E402

# Small models (head_dim 16, rope_theta 12345, 64 positions) scaled from a pre-training context of 16: every
# frequency of llama3 is scaled or smoothed, yarn's ramp spans dimensions 0..3 (beta 8 / 0.25) or 0..1.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},  # attention factor derived
    "yarn_explicit": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
                      "beta_slow": 0.25, "attention_factor": 1.25},
}
# Real models' settings: Llama 3.1 8B, a 128k YaRN (Qwen2.5-style), and 4x position interpolation.
REAL = [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 128, 5e5, 131072),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6, 131072),
    ({"rope_type": "linear", "factor": 4.0}, 128, 1e4, 16384),
] + [(rope, 16, 12345.0, 64) for rope in SCALINGS.values()]


def ulps(a, b):
  """How many float32 steps apart a and b are, elementwise (both positive)."""
  return np.abs(a.astype(np.float32).view(np.int32).astype(np.int64) - b.astype(np.float32).view(np.int32))


@pytest.mark.parametrize("rope, head_dim, theta, max_len", REAL, ids=lambda v: v["rope_type"] if isinstance(v, dict)
                         else str(v))
def test_inverse_frequencies_and_attention_factor_are_transformers(rope, head_dim, theta, max_len):
  config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                                    max_position_embeddings=max_len, rope_scaling=dict(rope))
  want_U, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
  cfg = hf.config_from_hf(config.to_dict())
  got_U = layers.FREQUENCIES[cfg.rope_scaling](cfg, head_dim)
  assert got_U.dtype == np.float32 and got_U.shape == (head_dim // 2,)
  assert ulps(got_U, want_U.numpy()).max() <= 2  # torch's powf rounds a few exponents otherwise
  assert layers.attention_factor(cfg) == want_factor
  none_U = np.asarray(layers.FREQUENCIES["none"](cfg, head_dim))
  assert np.abs(got_U / none_U - 1).max() > 0.5  # the scaling changes some frequency by more than half


@pytest.fixture(scope="module")
def tokens_BL():
  return np.random.default_rng(0).integers(0, 128, (2, 64)).astype(np.int32)  # 64 positions, 4x the original 16


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name == "llama3" else pytest.mark.slow)
                                  for name in SCALINGS])
def test_logits_match_transformers_both_ways(tmp_path, tokens_BL, name):
  """HF -> jaxtrain: the imported model's logits against transformers'; jaxtrain -> HF: transformers' logits of
  the exported directory against jaxtrain's. Both to 1e-4 in float32 (measured: <= 4e-6), where the same weights
  without scaling are off by more than 1. One layer: rope acts the same in every layer."""
  model = hf_model(tie=False, head_dim=16, num_hidden_layers=1, rope_scaling=dict(SCALINGS[name]))
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  want = hf_logits(model, tokens_BL)
  unscaled = hf_logits(hf_model(tie=False, head_dim=16, num_hidden_layers=1), tokens_BL)  # same seed, same weights
  assert np.abs(unscaled - want).max() > 1.0

  cfg, params, apply_fn = pretrained.load_pretrained(str(tmp_path / "hf"))
  assert cfg.rope_scaling == SCALINGS[name]["rope_type"]
  ours = np.asarray(apply_fn(params, tokens_BL))
  assert np.abs(ours - want).max() < 1e-4

  hf.export_hf(cfg, params, str(tmp_path / "out"))
  with open(tmp_path / "out" / "config.json") as f:
    written = json.load(f)["rope_scaling"]
  assert written["rope_type"] == SCALINGS[name]["rope_type"]
  assert ("attention_factor" in written) == ("attention_factor" in SCALINGS[name])  # else transformers derives it
  assert np.abs(hf_logits(from_pretrained(tmp_path / "out"), tokens_BL) - ours).max() < 1e-4


@pytest.mark.parametrize("name", SCALINGS)
def test_config_round_trips_through_hf_and_mixtral(name):
  """Export writes every rope field the type reads; import reads them back, Llama's rope_scaling and Mixtral's
  rope_parameters alike, and transformers' configs see the same values."""
  cfg = hf.config_from_hf({**BASE, "max_position_embeddings": 64, "rope_scaling": dict(SCALINGS[name])})
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
  moe = hf.config_from_hf({**MIXTRAL, "num_key_value_heads": 2, "max_position_embeddings": 64,
                           "rope_parameters": dict(SCALINGS[name])})
  out = hf.config_to_hf(moe)
  assert hf.config_from_hf(out) == moe and moe.rope_scaling == cfg.rope_scaling
  rope = transformers.MixtralConfig(**{k: v for k, v in out.items() if k != "architectures"}).rope_parameters
  assert {k: rope[k] for k in SCALINGS[name]} == SCALINGS[name]


def test_transformers_fallbacks_are_read():
  """A bare old-style `type`, original_max_position_embeddings at the top level (Phi-3 style) or absent
  (max_position_embeddings), yarn's factor from the two lengths and its beta defaults."""
  cfg = hf.config_from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 2}})
  assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 2.0)
  yarn = {"rope_type": "yarn", "original_max_position_embeddings": 16, "beta_fast": None}
  cfg = hf.config_from_hf({**BASE, "max_position_embeddings": 64, "rope_parameters": yarn})
  assert (cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_beta_fast, cfg.rope_beta_slow) == (4.0, 16, 32.0, 1.0)
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  assert hf.config_from_hf({**BASE, "max_position_embeddings": 64, "rope_scaling": llama3}).rope_original_max_len == 64
  cfg = hf.config_from_hf({**BASE, "original_max_position_embeddings": 32,
                           "rope_scaling": {**llama3, "original_max_position_embeddings": 16}})
  assert cfg.rope_original_max_len == 32
  scaled = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}  # rope_scaling wins over rope_parameters
  cfg = hf.config_from_hf({**BASE, "rope_scaling": scaled, "rope_parameters": {"rope_type": "default"}})
  assert (cfg.rope_scaling, cfg.rope_theta) == ("linear", 5e5)


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling rope_type 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_parameters rope_type 'longrope' is not supported"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0]}}, "rope_type 'su' is not supported"),
    ({"rope_scaling": {"rope_type": ["yarn"]}}, "rope_type ['yarn'] is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "truncate=false"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7}}, "mscale"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling linear lacks factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, "factor='4' is not a finite number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor=-2.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "llama3 lacks"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     "rope_low_freq_factor=4.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}}, "attention_factor=0.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16.5}},
     "original_max_position_embeddings=16.5"),
    ({"original_max_position_embeddings": "8192"}, "original_max_position_embeddings='8192'"),
])
def test_import_refuses_what_it_cannot_compute_with_one_line(change, named):
  with pytest.raises(ValueError) as e:
    hf.config_from_hf({**BASE, **change})
  assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_defaults_are_no_scaling():
  cfg = hf.config_from_hf(BASE)
  assert cfg.rope_scaling == "none" and cfg == config_lib.ModelConfig(**{
      **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if not f.name.startswith("rope_")},
      "rope_theta": cfg.rope_theta})
  assert hf.config_to_hf(cfg)["rope_scaling"] is None and layers.attention_factor(cfg) == 1.0


@pytest.mark.parametrize("name", SCALINGS)
def test_imported_scaling_is_a_valid_training_config(name):
  cfg = hf.config_from_hf({**BASE, "max_position_embeddings": 64, "rope_scaling": dict(SCALINGS[name])})
  rope = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("rope_")}
  config_lib.validate(tiny_config(model=rope), 8)
