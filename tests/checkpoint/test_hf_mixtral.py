"""HF Mixtral import/export (`convert`, load_pretrained, export_hf) against transformers' own
MixtralForCausalLM, logits to 1e-4, in both expert layouts that transformers reads."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import orbax.checkpoint as ocp  # noqa: E402

from jaxtrain import __main__ as cli  # noqa: E402
from jaxtrain.checkpoint import convert, hf, pretrained  # noqa: E402
from jaxtrain.checkpoint import safetensors_io  # noqa: E402
from jaxtrain.checkpoint.safetensors_io import tensor_index  # noqa: E402
from tests.fixtures import tiny_config  # noqa: E402

torch.set_grad_enabled(False)
TOKENS_BL = np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)
N_LEAVES = 13  # embed, q, k, v, o, 2 norms, router, gate, up, down, final norm, unembed


def hf_mixtral(seed: int = 0):
  """A tiny random float32 Mixtral (4 experts top-2, GQA, untied, rope_theta 12345); every weight is
  perturbed, and the router scaled up so that no token's top-2 is a near-tie (checked below)."""
  torch.manual_seed(seed)
  config = transformers.MixtralConfig(
      vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=48, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
      rope_theta=12345.0, rms_norm_eps=1e-5, router_aux_loss_coef=0.02, tie_word_embeddings=False,
      attn_implementation="eager")
  model = transformers.MixtralForCausalLM(config).float().eval()
  for name, p in model.named_parameters():
    p.copy_((p + 0.1 * torch.randn_like(p)) * (3 if name.endswith("mlp.gate.weight") else 1))
  return model


def hf_logits(model, tokens_BL):
  return model(torch.from_numpy(tokens_BL).long()).logits.numpy()


def from_pretrained(path):
  return transformers.MixtralForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """The model saved by save_pretrained in its default (hub, per-expert) and its fused layout, and
  the default one converted to a workdir with `convert --from_hf`; records the leaves it saved."""
  root = tmp_path_factory.mktemp("mixtral")
  model = hf_mixtral()
  model.save_pretrained(root / "hf", safe_serialization=True)
  model.save_pretrained(root / "fused", safe_serialization=True, save_original_format=False)
  saved, real = [], convert.save_leaf
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(convert, "save_leaf", lambda staging, path, leaf: (saved.append((path, leaf.shape)),
                                                                   real(staging, path, leaf)))
    assert cli.main(["convert", "--from_hf", str(root / "hf"), "--to", str(root / "wd")]) == 0
  return root, model, saved


def test_routing_is_decisive_and_uses_every_expert(converted):
  """Guards the comparisons below: a top-2 near-tie in the router logits (numerical error ~1e-6)
  could flip between implementations, a negligible second gate would hide a wrong second expert,
  and an unused expert would let a permutation of experts pass."""
  _, model, _ = converted
  for logits_SE in model(torch.from_numpy(TOKENS_BL).long(), output_router_logits=True).router_logits:
    logits_SE = logits_SE.numpy()
    ranked_SE = np.sort(logits_SE, axis=-1)
    assert (ranked_SE[:, -2] - ranked_SE[:, -3]).min() > 1e-3
    second_S = 1 / (1 + np.exp(ranked_SE[:, -1] - ranked_SE[:, -2]))  # its renormalized gate
    assert np.median(second_S) > 0.1
    assert len(np.unique(np.argsort(logits_SE, axis=-1)[:, -2:])) == 4


def test_both_layouts_exist_and_import_to_the_same_params(converted, monkeypatch):
  root, _, _ = converted
  hub, fused = tensor_index(str(root / "hf")), tensor_index(str(root / "fused"))
  assert hub["model.layers.1.block_sparse_moe.experts.3.w1.weight"][2] == (48, 64)
  assert hub["model.layers.1.block_sparse_moe.gate.weight"][2] == (4, 64)
  assert fused["model.layers.1.mlp.experts.gate_up_proj"][2] == (4, 96, 64)
  assert fused["model.layers.1.mlp.experts.down_proj"][2] == (4, 64, 48)
  _, want = hf.import_hf(str(root / "hf"))
  monkeypatch.setattr(safetensors_io, "BLOCK_BYTES", 1000)  # an expert's [2F, D] rows exceed a block: read row by row
  _, got = hf.import_hf(str(root / "fused"))
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_convert_from_hf_gives_transformers_logits(converted):
  root, model, saved = converted
  assert len(saved) == N_LEAVES and (("layers", "moe", "gate"), (2, 4, 64, 48)) in saved  # one leaf each
  want = hf_logits(model, TOKENS_BL)
  for path in (root / "wd", root / "hf", root / "fused"):
    cfg, params, apply_fn = pretrained.load_pretrained(str(path))
    assert (cfg.n_experts, cfg.top_k, cfg.d_ff_expert, cfg.router, cfg.renormalize, cfg.dispatch) == \
        (4, 2, 48, "softmax", True, "dropless")
    assert (cfg.rope_theta, cfg.tie_embeddings, cfg.n_kv_heads, cfg.norm_eps) == (12345.0, False, 2, 1e-5)
    assert np.abs(np.asarray(apply_fn(params, TOKENS_BL)) - want).max() < 1e-4, path
  saved_model = json.loads((root / "wd" / "config.json").read_text())["model"]
  assert (saved_model["n_experts"], saved_model["top_k"], saved_model["d_ff_expert"]) == (4, 2, 48)
  assert saved_model["aux_loss_weight"] == pytest.approx(2 * 0.02)  # HF's loss is top_k times ours


def test_convert_to_hf_loads_in_transformers(converted, capsys):
  root, model, _ = converted
  assert cli.main(["convert", "--from", str(root / "wd"), "--to_hf", str(root / "out")]) == 0
  capsys.readouterr()
  assert sorted(os.listdir(root / "out")) == ["config.json", "model.safetensors"]
  assert set(tensor_index(str(root / "out"))) == set(tensor_index(str(root / "hf")))  # the hub layout
  config = transformers.AutoConfig.from_pretrained(root / "out")
  assert isinstance(config, transformers.MixtralConfig)
  assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (4, 2, 48)
  assert config.rope_parameters["rope_theta"] == 12345.0 and config.router_aux_loss_coef == pytest.approx(0.02)
  assert np.abs(hf_logits(from_pretrained(root / "out"), TOKENS_BL) - hf_logits(model, TOKENS_BL)).max() < 1e-4


def test_fused_import_and_sharded_export(converted, tmp_path):
  root, model, _ = converted
  cfg, params = hf.import_hf(str(root / "fused"))
  hf.export_hf(cfg, params, str(tmp_path / "out"), max_shard_bytes=60_000)
  with open(tmp_path / "out" / "model.safetensors.index.json") as f:
    assert len(set(json.load(f)["weight_map"].values())) > 2
  assert np.abs(hf_logits(from_pretrained(tmp_path / "out"), TOKENS_BL) - hf_logits(model, TOKENS_BL)).max() < 1e-4


MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 48}


def test_config_defaults_are_mixtrals():
  """Keys a config.json omits take MixtralConfig's defaults, not LlamaConfig's."""
  cfg, want = hf.config_from_hf(MIXTRAL), transformers.MixtralConfig(**MIXTRAL)
  assert (cfg.max_seq_len, cfg.norm_eps, cfg.rope_theta, cfg.n_kv_heads, cfg.n_experts, cfg.top_k) == (
      want.max_position_embeddings, want.rms_norm_eps, want.rope_parameters["rope_theta"],
      want.num_key_value_heads, want.num_local_experts, want.num_experts_per_tok)
  assert hf.config_from_hf({**MIXTRAL, "sliding_window": 4096 * 32}).n_experts == 8  # never slides


@pytest.mark.parametrize("change", [{"sliding_window": 4096}, {"sliding_window": 4096 * 32 - 1},  # window < positions
                                    {"num_experts_per_tok": 9}, {"hidden_act": "gelu"},
                                    {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}])
def test_config_refuses_what_jaxtrain_cannot_run(change):
  with pytest.raises(ValueError) as e:
    hf.config_from_hf({**MIXTRAL, **change})
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("change", [{"n_shared_experts": 1}, {"router": "sigmoid"}, {"moe_first_dense": 1},
                                    {"moe_every": 2}, {"renormalize": False}, {"route_scale": 2.5},
                                    {"bias_update_rate": 1e-3}])
def test_export_refuses_moe_that_mixtral_cannot_express(change):
  cfg = hf.config_from_hf({**MIXTRAL, "num_hidden_layers": 4})
  assert hf.config_to_hf(cfg)["model_type"] == "mixtral"
  with pytest.raises(ValueError, match=next(iter(change))):
    hf.config_to_hf(dataclasses.replace(cfg, **change))


def test_convert_to_hf_refuses_shared_experts_with_one_line(tmp_path, capsys):
  cfg = tiny_config(model={"n_experts": 4, "n_shared_experts": 1})
  shapes = hf.param_shapes(hf.ModelConfig.from_config(cfg.model))
  params = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple))
  mngr = ocp.CheckpointManager(str(tmp_path / "wd" / "checkpoints"), item_names=("state", "meta"))
  mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params}),
                                       meta=ocp.args.JsonSave({"format": 1, "config": cfg.to_dict()})))
  mngr.wait_until_finished()
  assert cli.main(["convert", "--from", str(tmp_path / "wd" / "checkpoints"), "--to_hf", str(tmp_path / "out")]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1 and "n_shared_experts=1" in err, err
  assert not os.path.exists(tmp_path / "out")
