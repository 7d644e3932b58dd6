"""Hugging Face BERT masked-LM checkpoints (BertForMaskedLM: config.json + safetensors) to and from
the parameters of jaxtrain's encoder (model.arch=encoder, jaxtrain/model/encoder.py).

The same shape as hf.py (Llama, Mixtral): `config_from_hf` refuses in one line what the encoder
does not compute as transformers does (check_architecture), `leaf_plan` lists (our path, shape, HF
sources) and import and export stream one leaf at a time through safetensors_io. Layouts: a Linear
weight [out, in] maps as `ours = hf.T.reshape(ours_shape)` (query [H*K, D] -> q [D, H, K], the
attention's output.dense [D, H*K] -> o [H, K, D]), a bias as `hf.reshape(ours_shape)`, embeddings
and LayerNorms as they are. The MLM head's decoder is the word embedding (tied, as BertForMaskedLM
saves it: no cls.predictions.decoder.weight) with cls.predictions.bias. BertForPreTraining's pooler
and next-sentence head, and old checkpoints' tied copies and position_ids buffer, are not part of
the masked LM: import skips them. Old checkpoints' LayerNorm.gamma / beta read as weight / bias.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.checkpoint import safetensors_io as sio
from jaxtrain.checkpoint.hf import get_at, set_at
from jaxtrain.model.encoder import Encoder
from jaxtrain.model.transformer import ModelConfig

# HF name suffix inside bert.encoder.layer.{i}. -> our path under params["layers"]
LAYER_TENSORS = {
    "attention.self.query.weight": ("attn", "q"), "attention.self.query.bias": ("attn", "q_bias"),
    "attention.self.key.weight": ("attn", "k"), "attention.self.key.bias": ("attn", "k_bias"),
    "attention.self.value.weight": ("attn", "v"), "attention.self.value.bias": ("attn", "v_bias"),
    "attention.output.dense.weight": ("attn", "o"), "attention.output.dense.bias": ("attn", "o_bias"),
    "attention.output.LayerNorm.weight": ("attn_norm", "scale"),
    "attention.output.LayerNorm.bias": ("attn_norm", "bias"),
    "intermediate.dense.weight": ("mlp", "up"), "intermediate.dense.bias": ("mlp", "up_bias"),
    "output.dense.weight": ("mlp", "down"), "output.dense.bias": ("mlp", "down_bias"),
    "output.LayerNorm.weight": ("mlp_norm", "scale"), "output.LayerNorm.bias": ("mlp_norm", "bias"),
}
# HF name -> our path, outside the layers
TOP_TENSORS = {
    "bert.embeddings.word_embeddings.weight": ("embed",),
    "bert.embeddings.position_embeddings.weight": ("position_embed",),
    "bert.embeddings.token_type_embeddings.weight": ("type_embed",),
    "bert.embeddings.LayerNorm.weight": ("embed_norm", "scale"),
    "bert.embeddings.LayerNorm.bias": ("embed_norm", "bias"),
    "cls.predictions.transform.dense.weight": ("head",),
    "cls.predictions.transform.dense.bias": ("head_bias",),
    "cls.predictions.transform.LayerNorm.weight": ("head_norm", "scale"),
    "cls.predictions.transform.LayerNorm.bias": ("head_norm", "bias"),
    "cls.predictions.bias": ("output_bias",),
}
# not the masked LM's (BertForPreTraining's pooler and NSP head), or tied copies and buffers
IGNORED = ("bert.pooler.", "cls.seq_relationship.", "bert.embeddings.position_ids",
           "cls.predictions.decoder.")
# config.json values that BertConfig assumes for absent keys
HF_DEFAULTS = {"max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
               "hidden_act": "gelu", "position_embedding_type": "absolute",
               "tie_word_embeddings": True}
REQUIRED_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")


def is_bert(hf_dir: str) -> bool:
  """Whether a HF directory's config.json says model_type bert (False when it is unreadable: the
  Llama reader then says why)."""
  try:
    with open(os.path.join(hf_dir, "config.json"), "rb") as f:
      hf = json.loads(f.read())
  except (OSError, ValueError):
    return False
  return isinstance(hf, dict) and hf.get("model_type") == "bert"


def check_architecture(hf: dict) -> None:
  """ValueError (one line, naming it) for the first setting of a BERT config.json that the encoder
  does not compute as BertForMaskedLM does."""
  if hf.get("model_type") != "bert":
    raise ValueError(f"model_type {hf.get('model_type')!r} is not bert")
  for key in REQUIRED_INTS:
    if type(hf.get(key)) is not int or hf[key] <= 0:
      raise ValueError(f"{key}={hf.get(key)!r} is not a positive integer")
  get = lambda key: hf.get(key, HF_DEFAULTS.get(key))  # noqa: E731
  architectures = hf.get("architectures") or ["BertForMaskedLM"]
  if architectures != ["BertForMaskedLM"]:
    raise ValueError(f"architectures {architectures} is not supported (only BertForMaskedLM)")
  if get("hidden_act") != "gelu":
    raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (only gelu, erf's)")
  if get("position_embedding_type") != "absolute":
    raise ValueError(f"position_embedding_type {get('position_embedding_type')!r} is not supported "
                     "(only absolute)")
  for key in ("is_decoder", "add_cross_attention"):
    if hf.get(key):
      raise ValueError(f"{key}=True is not supported (a bidirectional encoder only)")
  if not get("tie_word_embeddings"):
    raise ValueError("tie_word_embeddings=False is not supported (the MLM decoder is the word "
                     "embedding)")
  if hf["hidden_size"] % hf["num_attention_heads"]:
    raise ValueError(f"hidden_size={hf['hidden_size']} is not a multiple of "
                     f"num_attention_heads={hf['num_attention_heads']}")
  if hf.get("quantization_config"):
    raise ValueError("quantization_config is not supported (only unquantized weights)")


def config_from_hf(hf: dict) -> ModelConfig:
  """The encoder's ModelConfig from a BertConfig dict; dropout acts only in training: ignored."""
  check_architecture(hf)
  get = lambda key: hf.get(key, HF_DEFAULTS.get(key))  # noqa: E731
  heads = hf["num_attention_heads"]
  return ModelConfig(
      arch="encoder", positions="learned", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=heads,
      head_dim=hf["hidden_size"] // heads, d_ff=hf["intermediate_size"],
      max_seq_len=get("max_position_embeddings"), type_vocab_size=get("type_vocab_size"),
      norm_eps=float(get("layer_norm_eps")), tie_embeddings=True)


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
  """config.json of a BertForMaskedLM; ValueError (one line) for an encoder BERT cannot express."""
  if cfg.arch != "encoder":
    raise ValueError("a BERT checkpoint holds an encoder (model.arch=encoder), not a decoder")
  if cfg.positions != "learned" or cfg.n_kv_heads != cfg.n_heads or \
      cfg.head_dim * cfg.n_heads != cfg.d_model:
    raise ValueError(
        f"BERT needs learned positions, n_kv_heads == n_heads and head_dim * n_heads == d_model; "
        f"got positions={cfg.positions!r}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, "
        f"head_dim={cfg.head_dim}, d_model={cfg.d_model}")
  return {
      "architectures": ["BertForMaskedLM"], "model_type": "bert", "torch_dtype": dtype,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.max_seq_len,
      "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.norm_eps,
      "hidden_act": "gelu", "position_embedding_type": "absolute", "tie_word_embeddings": True,
      "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
      "initializer_range": cfg.init_std, "pad_token_id": 0,
  }


def param_shapes(cfg: ModelConfig) -> dict:
  """The parameter tree of Encoder(cfg) as shapes, without allocating it."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  abstract = jax.eval_shape(Encoder(cfg).init, jax.random.key(0), tokens)["params"]
  abstract = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, abstract,
                          is_leaf=lambda x: hasattr(x, "unbox"))
  return jax.tree.map(lambda x: x.shape, abstract)


def leaf_plan(cfg: ModelConfig):
  """(our path, leaf shape, [(hf name, index, None), ...]) for every parameter leaf, in order; a
  stacked [layers, ...] leaf takes one HF tensor per layer."""
  shapes = param_shapes(cfg)
  plan = [(path, get_at(shapes, path), [(name, (), None)]) for name, path in TOP_TENSORS.items()
          if get_at(shapes, path) is not None]
  for suffix, path in LAYER_TENSORS.items():
    sources = [(f"bert.encoder.layer.{i}.{suffix}", (i,), None) for i in range(cfg.n_layers)]
    plan.append((("layers",) + path, get_at(shapes["layers"], path), sources))
  return plan


def hf_shape(name: str, shape) -> tuple:
  """HF's shape for our tensor `name` of `shape`: [out, in] for a Linear weight, flat for a bias,
  as they are for embeddings and LayerNorms."""
  if "embeddings" in name or "LayerNorm" in name:
    return tuple(shape)
  if name.endswith("bias"):
    return (int(np.prod(shape)),)
  n_in = 2 if name.endswith("attention.output.dense.weight") else 1  # o [H, K, D]
  return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def to_hf(name: str, w):
  """Our tensor `w` in HF's layout: a view when `w` is contiguous (writable for a numpy array)."""
  shape = hf_shape(name, w.shape)
  if "embeddings" in name or "LayerNorm" in name or len(shape) == 1:
    return w.reshape(shape)
  return w.reshape(shape[::-1]).T


def aliased(index: dict) -> dict:
  """The tensor index with old checkpoints' LayerNorm.gamma / beta also under weight / bias."""
  out = dict(index)
  for name, entry in index.items():
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
      if "LayerNorm" in name and name.endswith(old):
        out[name[:-len(old)] + new] = entry
  return out


def check_tensors(cfg: ModelConfig, index: dict, hf_dir: str) -> None:
  """ValueError unless `index` holds the tensors of `cfg`, with their shapes (the skipped ones
  aside)."""
  plan = leaf_plan(cfg)
  for _, shape, sources in plan:
    for name, where, _ in sources:
      want = hf_shape(name, shape[len(where):])
      if name not in index:
        raise ValueError(f"{hf_dir} lacks tensor {name}")
      if tuple(index[name][2]) != want:
        raise ValueError(f"{name} has shape {tuple(index[name][2])}, expected {want}")
  used = {name for *_, sources in plan for name, *_ in sources}
  unknown = [n for n in index if n not in used and not n.startswith(IGNORED)
             and not (n.endswith((".gamma", ".beta")) and "LayerNorm" in n)]
  if unknown:
    raise ValueError(
        f"unexpected tensors in {hf_dir} (e.g. {unknown[:3]}); config and weights disagree")


def read_config(hf_dir: str) -> ModelConfig:
  path = os.path.join(hf_dir, "config.json")
  try:
    with open(path, "rb") as f:
      hf = json.loads(f.read())
    if not isinstance(hf, dict):
      raise ValueError(f"config.json is not a JSON object (got {type(hf).__name__})")
    return config_from_hf(hf)
  except ValueError as e:
    raise ValueError(f"{path}: {e}".splitlines()[0]) from None


def read_leaves(hf_dir: str, cfg: ModelConfig, dtype=np.float32):
  """Yields (our path, numpy leaf) one leaf at a time, after every name and shape is checked."""
  index = aliased(sio.tensor_index(hf_dir))
  check_tensors(cfg, index, hf_dir)
  for path, shape, sources in leaf_plan(cfg):
    leaf = np.empty(shape, dtype)
    for name, where, _ in sources:
      sio.read_into(index, name, to_hf(name, leaf[where]))
    yield path, leaf
    del leaf


def import_hf(hf_dir: str):
  """(ModelConfig, params) of a HF BertForMaskedLM directory, as float32 numpy arrays."""
  cfg = read_config(hf_dir)
  params = {}
  for path, leaf in read_leaves(hf_dir, cfg):
    set_at(params, path, leaf)
  return cfg, params


def write_hf(cfg: ModelConfig, out_dir: str, leaf_fn, dtype: str = "float32",
             max_shard_bytes: int = 5 * 2**30) -> None:
  """config.json and one model.safetensors of a BertForMaskedLM, tensor by tensor; `leaf_fn(path)`
  gives our leaf at `path`, called once per leaf. (`max_shard_bytes`: hf.write_hf's argument;
  BERT's checkpoints fit one file, so it is not cut.)"""
  del max_shard_bytes
  hf_config = config_to_hf(cfg, dtype)
  entries = [(name, path, where, hf_shape(name, shape[len(where):]))
             for path, shape, sources in leaf_plan(cfg) for name, where, _ in sources]
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  held = {}

  def tensors():
    for name, path, where, _ in entries:
      if path not in held:
        held.clear()
        held[path] = leaf_fn(path)
      yield name, to_hf(name, np.asarray(held[path])[where])

  sio.write_safetensors(os.path.join(out_dir, "model.safetensors"),
                        [(n, s) for n, _, _, s in entries], tensors(), dtype)
  held.clear()


def export_hf(cfg: ModelConfig, params, out_dir: str, dtype: str = "float32") -> None:
  """Writes params (numpy or jax arrays) as a HF BertForMaskedLM directory."""
  params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                        is_leaf=lambda x: hasattr(x, "unbox"))
  write_hf(cfg, out_dir, lambda path: get_at(params, path), dtype)
