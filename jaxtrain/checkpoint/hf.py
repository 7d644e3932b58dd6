"""Hugging Face Llama and Mixtral checkpoints (config.json + safetensors) to and from jaxtrain
parameters.

Both directions stream: import fills one leaf at a time (a stacked [N, ...] leaf layer by layer) by
copying each HF tensor's bytes, a block of rows at a time, from the file into a view of the leaf in
HF's layout; export writes each tensor, a block at a time, from such a view into its shard. So host
memory holds one leaf and one block: no whole temporary copy, and no memory-mapped file
(`safetensors.safe_open` maps it, and every page read then counts in the process's resident memory).
HF Llama's and Mixtral's q/k weights already use the half-split (rotate_half) rope layout of
`layers.rope`, so no permutation is needed. Rope scaling (`rope_scaling`, or transformers 5's
`rope_parameters`) of type linear, llama3 or yarn maps onto ModelConfig's rope_* keys (hf_rope.py);
export writes it back as `rope_scaling`, which transformers 4 and 5 read. Other types (dynamic,
longrope, ...) are refused.

Layouts (HF weights are [out, in]; ours are [in, ...out]): every matrix except the embedding maps
as `ours = hf.T.reshape(ours_shape)`, e.g. q_proj [H*K, D] -> q [D, H, K], o_proj [D, H*K] ->
o [H, K, D], down_proj [D, F] -> down [F, D], lm_head [V, D] -> unembed [D, V].

Mixtral: the router gate.weight [E, D] -> moe/router [D, E]; expert j's w1 (gate), w3 (up) [F, D]
and w2 (down) [D, F] -> moe/gate[j], moe/up[j] [D, F] and moe/down[j] [F, D]. Hub checkpoints and
the default `save_pretrained` of transformers 5 store experts that way, under `block_sparse_moe.`;
its modules (and `save_pretrained(save_original_format=False)`) fuse them under `mlp.`:
experts.gate_up_proj [E, 2F, D] (gate rows first) and experts.down_proj [E, D, F]. Import reads
either; export writes the per-expert hub layout, which every transformers version loads.
"""

import dataclasses
import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain.checkpoint import safetensors_io as sio
from jaxtrain.checkpoint.hf_rope import (check_rope, rope_dict, rope_scaling_from_hf,
                                         rope_scaling_to_hf)
from jaxtrain.model.transformer import ModelConfig, Transformer

# HF name suffix inside model.layers.{i}. -> our path under params["layers"].
LAYER_TENSORS = {
    "self_attn.q_proj.weight": ("attn", "q"),
    "self_attn.k_proj.weight": ("attn", "k"),
    "self_attn.v_proj.weight": ("attn", "v"),
    "self_attn.o_proj.weight": ("attn", "o"),
    "input_layernorm.weight": ("attn_norm", "scale"),
    "post_attention_layernorm.weight": ("mlp_norm", "scale"),
}
DENSE_TENSORS = {"mlp.gate_proj.weight": ("mlp", "gate"), "mlp.up_proj.weight": ("mlp", "up"),
                 "mlp.down_proj.weight": ("mlp", "down")}
# Mixtral expert weight of model.layers.{i}.{prefix}.experts.{j}. -> our leaf under
# params["layers"]["moe"]
EXPERT_TENSORS = {"w1.weight": "gate", "w3.weight": "up", "w2.weight": "down"}
FUSED = ("experts.gate_up_proj", "experts.down_proj")  # transformers 5's [E, 2F, D] and [E, D, F]
# What Mixtral's MoE block is in ModelConfig terms (its softmax-top-k-renormalize routing is our
# `route` with these); export refuses an MoE config that differs.
MIXTRAL_MOE = {"router": "softmax", "renormalize": True, "route_scale": 1.0, "n_shared_experts": 0,
               "moe_first_dense": 0, "moe_every": 1, "bias_update_rate": 0.0}
# config.json values that transformers assumes for absent keys (LlamaConfig / MixtralConfig)
HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001}
}
# The fields config_from_hf reads, with the type each must have: (key, check, what it must be).
REQUIRED_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "num_local_experts",
                 "num_experts_per_tok", "sliding_window", "original_max_position_embeddings")
FIELD_TYPES = ([(key, lambda v: type(v) is int and v > 0, "a positive integer")
                for key in REQUIRED_INTS + OPTIONAL_INTS] +
               [(key, lambda v: type(v) in
                 (int, float) and math.isfinite(v) and v >= 0, "a finite number >= 0")
                for key in ("rope_theta", "rms_norm_eps", "router_aux_loss_coef")] +
               [(key, lambda v: type(v) is bool, "true or false")
                for key in ("tie_word_embeddings", "attention_bias", "mlp_bias")] +
               [(key, lambda v: isinstance(v, dict), "an object")
                for key in ("rope_scaling", "rope_parameters")] +
               [("hidden_act", lambda v: isinstance(v, str), "a string")])
EMBED = "model.embed_tokens.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def config_from_hf(hf: dict) -> ModelConfig:
  """A ModelConfig from a LlamaConfig or MixtralConfig dict; refuses (check_architecture) what our
  model does not implement. Mixtral's router_jitter_noise and attention_dropout act only in
  training: ignored."""
  check_architecture(hf)
  defaults = HF_DEFAULTS[hf["model_type"]]
  get = lambda key: hf[key] if hf.get(key) is not None else defaults.get(key)  # noqa: E731
  rope = rope_dict(hf)  # transformers >= 5 nests rope_theta and the rope type here
  heads = hf["num_attention_heads"]
  cfg = ModelConfig(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"],
      n_heads=heads,
      n_kv_heads=get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      d_ff=hf["intermediate_size"],
      max_seq_len=get("max_position_embeddings"),
      rope_theta=float(rope.get("rope_theta") or get("rope_theta")),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=float(get("rms_norm_eps")),
      **rope_scaling_from_hf(hf, rope, get("max_position_embeddings")),
  )
  config_lib.validate_rope(cfg)
  if hf["model_type"] != "mixtral":
    return cfg
  e, k = get("num_local_experts"), get("num_experts_per_tok")
  if not 1 <= k <= e:
    raise ValueError(f"num_experts_per_tok={k} must be in [1, num_local_experts={e}]")
  # HF's load-balancing loss counts a token's k assignments against 1 (ours against k): k times
  # ours.
  return dataclasses.replace(cfg, n_experts=e, top_k=k, d_ff_expert=cfg.d_ff, dispatch="dropless",
                             aux_loss_weight=k * float(get("router_aux_loss_coef")), **MIXTRAL_MOE)


def check_architecture(hf) -> None:
  """ValueError (one line, naming it) for the first setting of a HF config.json that jaxtrain does
  not compute as transformers does: another model_type (Granite has Llama's tensors and other math),
  rope scaling, biases, another activation, sliding windows, quantized weights, ill-typed fields."""
  if not isinstance(hf, dict):
    raise ValueError(f"config.json is not a JSON object (got {type(hf).__name__})")
  if hf.get("model_type") not in HF_DEFAULTS:
    raise ValueError(
        f"model_type {hf.get('model_type')!r} is not supported ({', '.join(HF_DEFAULTS)})")
  _check_types(hf)
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"{key}=True is not supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
  check_rope(hf)
  if hf.get("quantization_config"):
    raise ValueError(f"quantization_config {hf['quantization_config']} is not supported "
                     "(only unquantized weights)")
  window = hf.get("sliding_window")
  max_pos = (hf.get("max_position_embeddings")
             or HF_DEFAULTS[hf["model_type"]]["max_position_embeddings"])
  if window is not None and window < max_pos:  # transformers masks keys more than window - 1 back
    raise ValueError(f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window "
                     "attention is not supported")
  heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
  if not hf.get("head_dim") and hf["hidden_size"] % heads:
    raise ValueError(
        f"hidden_size={hf['hidden_size']} is not a multiple of num_attention_heads={heads} "
        "(and there is no head_dim)")
  if heads % kv:
    raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")


def _check_types(hf: dict) -> None:
  """ValueError unless every field we read has the type transformers gives it."""
  for key in REQUIRED_INTS:
    if key not in hf:
      raise ValueError(f"config.json lacks {key}")
  for key, ok, want in FIELD_TYPES:
    if hf.get(key) is not None and not ok(hf[key]):
      raise ValueError(f"{key}={hf[key]!r} is not {want}")


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
  """config.json of a LlamaForCausalLM, or of a MixtralForCausalLM for an MoE config; ValueError
  (one line) for an MoE config that Mixtral cannot express."""
  out = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "torch_dtype": dtype,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.d_ff,
      "max_position_embeddings": cfg.max_seq_len,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": rope_scaling_to_hf(cfg),
      "tie_word_embeddings": cfg.tie_embeddings,
      "rms_norm_eps": cfg.norm_eps,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
  }
  if not cfg.n_experts:
    return out
  bad = [f"{key}={getattr(cfg, key)!r}" for key, want in MIXTRAL_MOE.items()
         if getattr(cfg, key) != want]
  if bad:
    need = ", ".join(f"{key}={want!r}" for key, want in MIXTRAL_MOE.items())
    raise ValueError(f"a Mixtral checkpoint cannot express {', '.join(bad)} (it needs {need})")
  for key in ("rope_scaling", "attention_bias", "mlp_bias"):
    del out[key]
  return {**out, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
          "intermediate_size": cfg.expert_d_ff, "num_local_experts": cfg.n_experts,
          "num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": cfg.aux_loss_weight / cfg.top_k,
          "router_jitter_noise": 0.0, "sliding_window": None,
          "rope_parameters": {"rope_type": "default", **(rope_scaling_to_hf(cfg) or {}),
                              "rope_theta": cfg.rope_theta}}


def param_shapes(cfg: ModelConfig) -> dict:
  """The parameter tree of Transformer(cfg) as shapes, without allocating it."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  abstract = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]
  return jax.tree.map(lambda x: x.shape, _unbox(abstract), is_leaf=lambda x: isinstance(x, tuple))


def leaf_plan(cfg: ModelConfig, moe_prefix: str = "block_sparse_moe", fused: bool = False):
  """(our path, leaf shape, [(hf name, index, half), ...]) for every parameter leaf, in order. Each
  HF tensor fills leaf[index]: a stacked [layers, ...] leaf takes one per layer, a Mixtral expert
  leaf [layers, E, ...] one per layer and expert (or one fused per layer, whose gate or up rows
  `half` 0 or 1 picks). `moe_prefix` and `fused` choose the Mixtral layout (see the module
  docstring)."""
  shapes, layers = param_shapes(cfg), range(cfg.n_layers)
  stacked = lambda path, sources: (("layers",) + path, get_at(shapes["layers"], path),  # noqa: E731
                                   sources)
  per_layer = {
      **LAYER_TENSORS,
      **({f"{moe_prefix}.gate.weight": ("moe", "router")} if cfg.n_experts else DENSE_TENSORS)
  }
  plan = [(("embed",), shapes["embed"], [(EMBED, (), None)])]
  plan += [stacked(path, [(f"model.layers.{i}.{suffix}", (i,), None) for i in layers])
           for suffix, path in per_layer.items()]
  for suffix, ours in EXPERT_TENSORS.items() if cfg.n_experts else ():
    if fused:
      sources = [(f"model.layers.{i}.{moe_prefix}.{FUSED[ours == 'down']}", (i,),
                  {"gate": 0, "up": 1}.get(ours)) for i in layers]
    else:
      sources = [(f"model.layers.{i}.{moe_prefix}.experts.{j}.{suffix}", (i, j), None)
                 for i in layers for j in range(cfg.n_experts)]
    plan.append(stacked(("moe", ours), sources))
  plan.append(
      (("final_norm", "scale"), shapes["final_norm"]["scale"], [("model.norm.weight", (), None)]))
  if not cfg.tie_embeddings:
    plan.append((("unembed",), shapes["unembed"], [("lm_head.weight", (), None)]))
  return plan


def moe_layout(index: dict) -> dict:
  """leaf_plan's Mixtral layout arguments for the tensor names of a checkpoint."""
  fused = any(name.endswith(FUSED[0]) for name in index)
  native = any(".mlp.gate.weight" in name or ".mlp.experts." in name for name in index)
  return {"moe_prefix": "mlp" if native else "block_sparse_moe", "fused": fused}


def hf_shape(name: str, shape) -> tuple:
  """HF's [out, in] shape for our tensor `name` of `shape` (embedding and norms keep theirs); a
  fused expert tensor is [E, out, in], gate_up_proj with 2F rows (gate, then up) for our [E, D,
  F]."""
  if name.endswith(FUSED):
    e, n_in, n_out = shape
    return (e, 2 * n_out if name.endswith(FUSED[0]) else n_out, n_in)
  if name == EMBED or len(shape) == 1:
    return tuple(shape)
  n_in = 2 if name.endswith("o_proj.weight") else 1  # o [H, K, D]: heads and head dim are its input
  return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def to_hf(name: str, w):
  """Our tensor `w` in HF's layout: a view when `w` is contiguous (writable for a numpy array). For
  a fused expert tensor, the [E, out, in] view of its part (gate_up_proj: our gate or up)."""
  if name.endswith(FUSED):
    return w.swapaxes(-1, -2)
  return w if name == EMBED else w.reshape(hf_shape(name, w.shape)[::-1]).T


def is_hf_dir(path: str) -> bool:
  """A directory with config.json and *.safetensors (a jaxtrain workdir has no safetensors)."""
  return (os.path.isfile(os.path.join(path, "config.json"))
          and bool(glob.glob(os.path.join(path, "*.safetensors"))))


def read_config(hf_dir: str) -> ModelConfig:
  """The ModelConfig of a HF directory's config.json; ValueError (one line, naming the file) when it
  is not JSON or not a config that jaxtrain implements."""
  path = os.path.join(hf_dir, "config.json")
  try:
    with open(path, "rb") as f:
      return config_from_hf(json.loads(f.read()))
  except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise ValueError(f"{path}: {e}".splitlines()[0]) from None


def check_tensors(cfg: ModelConfig, index: dict, hf_dir: str) -> None:
  """ValueError unless `index` holds exactly the tensors of `cfg`, with their shapes."""
  plan = leaf_plan(cfg, **moe_layout(index))
  for _, shape, sources in plan:
    for name, where, _ in sources:
      want = hf_shape(name, shape[len(where):])
      if name not in index:
        raise ValueError(f"{hf_dir} lacks tensor {name}")
      if index[name][2] != want:
        raise ValueError(f"{name} has shape {index[name][2]}, expected {want}")
  used = {name
          for *_, sources in plan
          for name, *_ in sources} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
  unknown = [n for n in index if n not in used and not n.endswith(IGNORED_SUFFIXES)]
  if unknown:
    raise ValueError(
        f"unexpected tensors in {hf_dir} (e.g. {unknown[:3]}); config and weights disagree")


def read_leaves(hf_dir: str, cfg: ModelConfig, dtype=np.float32):
  """Yields (our path, numpy leaf) one leaf at a time; a stacked leaf is filled layer by layer.
  Host memory holds the leaf and one block of rows. Checks every name and shape before reading."""
  index = sio.tensor_index(hf_dir)
  check_tensors(cfg, index, hf_dir)
  for path, shape, sources in leaf_plan(cfg, **moe_layout(index)):
    leaf = np.empty(shape, dtype)
    for name, where, half in sources:
      sio.read_into(index, name, to_hf(name, leaf[where]), half)
    yield path, leaf
    del leaf


def import_hf(hf_dir: str):
  """(ModelConfig, params) from a HF Llama or Mixtral directory; parameters come out as float32
  numpy arrays."""
  cfg = read_config(hf_dir)
  params = {}
  for path, leaf in read_leaves(hf_dir, cfg):
    set_at(params, path, leaf)
  return cfg, params


def write_hf(cfg: ModelConfig, out_dir: str, leaf_fn, dtype: str = "float32",
             max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes config.json and safetensors shards (plus the index json when more than one), tensor by
  tensor. `leaf_fn(path)` gives our leaf at `path`; it is called once per leaf, in `leaf_plan`
  order, and only the current leaf is held."""
  itemsize = np.dtype(sio.SAFETENSORS_DTYPES[dtype][1]).itemsize
  hf_config = config_to_hf(cfg, dtype)  # refuses an MoE config that Mixtral cannot express
  entries = [(name, path, where, hf_shape(name, shape[len(where):]))
             for path, shape, sources in leaf_plan(cfg) for name, where, _ in sources]
  shards, size = [[]], 0
  for entry in entries:
    nbytes = itemsize * int(np.prod(entry[3]))
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  names = ["model.safetensors"] if len(shards) == 1 else \
      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  held = {}  # the one leaf alive: {path: leaf}

  def tensors(shard):
    for name, path, where, _ in shard:
      if path not in held:
        held.clear()  # drop the previous leaf before reading the next
        held[path] = leaf_fn(path)
      leaf = held[path]
      yield name, to_hf(name, np.asarray(leaf)[where])
      del leaf  # else this frame would keep the leaf alive while the next one is read

  for fname, shard in zip(names, shards):
    sio.write_safetensors(os.path.join(out_dir, fname), [(n, s) for n, _, _, s in shard],
                          tensors(shard), dtype)
  held.clear()
  if len(shards) > 1:
    weight_map = {name: fname for fname, shard in zip(names, shards) for name, *_ in shard}
    total = sum(itemsize * int(np.prod(s)) for *_, s in entries)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def export_hf(cfg: ModelConfig, params, out_dir: str, max_shard_bytes: int = 5 * 2**30,
              dtype: str = "float32") -> None:
  """Writes params (numpy or jax arrays) as a HF Llama (or, for an MoE config, Mixtral) directory;
  see write_hf."""
  params = _unbox(params)
  write_hf(cfg, out_dir, lambda path: get_at(params, path), dtype, max_shard_bytes)


def _unbox(tree):
  return jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, tree,
                      is_leaf=lambda x: hasattr(x, "unbox"))


def get_at(tree, path):
  """tree[path[0]][path[1]]...; None where a key is absent."""
  for key in path:
    if key not in tree:
      return None
    tree = tree[key]
  return tree


def set_at(tree, path, value):
  """tree[path[0]][path[1]]... = value, making the dicts on the way."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
