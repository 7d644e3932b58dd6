"""Hugging Face Llama checkpoints (config.json + safetensors) to and from jaxtrain parameters.

Both directions stream one tensor at a time: import fills preallocated stacked [N, ...] arrays
layer by layer, export writes each tensor's bytes straight into its shard. HF Llama's q/k weights
already use the half-split (rotate_half) rope layout of `layers.rope`, so no permutation is needed.

Layouts (HF weights are [out, in]; ours are [in, ...out]): every matrix except the embedding maps
as `ours = hf.T.reshape(ours_shape)`, e.g. q_proj [H*K, D] -> q [D, H, K], o_proj [D, H*K] ->
o [H, K, D], down_proj [D, F] -> down [F, D], lm_head [V, D] -> unembed [D, V].
"""

import glob
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from jaxtrain.model.transformer import ModelConfig, Transformer

# HF name suffix inside model.layers.{i}. -> our path under params["layers"].
LAYER_TENSORS = {
    "self_attn.q_proj.weight": ("attn", "q"),
    "self_attn.k_proj.weight": ("attn", "k"),
    "self_attn.v_proj.weight": ("attn", "v"),
    "self_attn.o_proj.weight": ("attn", "o"),
    "mlp.gate_proj.weight": ("mlp", "gate"),
    "mlp.up_proj.weight": ("mlp", "up"),
    "mlp.down_proj.weight": ("mlp", "down"),
    "input_layernorm.weight": ("attn_norm", "scale"),
    "post_attention_layernorm.weight": ("mlp_norm", "scale"),
}
EMBED = "model.embed_tokens.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def config_from_hf(hf: dict) -> ModelConfig:
  """A ModelConfig from a LlamaConfig dict; refuses features our model does not implement."""
  rope = hf.get("rope_parameters") or {}  # transformers >= 5 nests rope_theta and the rope type here
  scaling = hf.get("rope_scaling") or rope
  if scaling.get("rope_type", scaling.get("type", "default")) != "default":
    raise ValueError(f"rope scaling is not supported: {scaling}")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ValueError("attention_bias / mlp_bias are not supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
  heads = hf["num_attention_heads"]
  # Defaults below are LlamaConfig's, for keys a config.json may omit.
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"],
      n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      d_ff=hf["intermediate_size"],
      max_seq_len=hf.get("max_position_embeddings", 2048),
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
  )


def config_to_hf(cfg: ModelConfig) -> dict:
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "torch_dtype": "float32",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.d_ff,
      "max_position_embeddings": cfg.max_seq_len,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "tie_word_embeddings": cfg.tie_embeddings,
      "rms_norm_eps": cfg.norm_eps,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
  }


def param_shapes(cfg: ModelConfig) -> dict:
  """The parameter tree of Transformer(cfg) as shapes, without allocating it."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  abstract = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]
  return jax.tree.map(lambda x: x.shape, _unbox(abstract), is_leaf=lambda x: isinstance(x, tuple))


def tensor_plan(cfg: ModelConfig):
  """(hf name, our path, layer index or None, our per-tensor shape) for every HF tensor, in order."""
  shapes = param_shapes(cfg)
  plan = [(EMBED, ("embed",), None, shapes["embed"])]
  for i in range(cfg.n_layers):
    for suffix, path in LAYER_TENSORS.items():
      plan.append((f"model.layers.{i}.{suffix}", ("layers",) + path, i, _get(shapes["layers"], path)[1:]))
  plan.append(("model.norm.weight", ("final_norm", "scale"), None, shapes["final_norm"]["scale"]))
  if not cfg.tie_embeddings:
    plan.append(("lm_head.weight", ("unembed",), None, shapes["unembed"]))
  return plan


def hf_shape(name: str, shape) -> tuple:
  """HF's [out, in] shape for our tensor `name` of `shape` (embedding and norms keep theirs)."""
  if name == EMBED or len(shape) == 1:
    return tuple(shape)
  n_in = 2 if name.endswith("o_proj.weight") else 1  # o [H, K, D]: heads and head dim are its input
  return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def to_ours(name: str, w, shape):
  return w if name == EMBED else w.T.reshape(shape)


def to_hf(name: str, w):
  return w if name == EMBED else w.reshape(hf_shape(name, w.shape)[::-1]).T


def import_hf(hf_dir: str):
  """(ModelConfig, params) from a HF Llama directory; parameters come out as float32 numpy arrays."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    cfg = config_from_hf(json.load(f))
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted({os.path.join(hf_dir, v) for v in json.load(f)["weight_map"].values()})
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
  where = {}  # tensor name -> (open file, its path)
  for path in files:
    handle = safetensors.safe_open(path, framework="numpy")
    where.update({name: (handle, path) for name in handle.keys()})
  plan = tensor_plan(cfg)
  params = {}
  for name, path, layer, shape in plan:
    if name not in where:
      raise ValueError(f"{hf_dir} lacks tensor {name}")
    w = _read_tensor(*where[name], name)
    if w.shape != hf_shape(name, shape):
      raise ValueError(f"{name} has shape {w.shape}, expected {hf_shape(name, shape)}")
    if layer is None:
      _set(params, path, to_ours(name, w, shape).astype(np.float32))
    else:
      if _get(params, path) is None:
        _set(params, path, np.empty((cfg.n_layers, *shape), np.float32))
      _get(params, path)[layer] = to_ours(name, w, shape)
    del w
  used = {name for name, *_ in plan} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
  unknown = [n for n in where if n not in used and not n.endswith(IGNORED_SUFFIXES)]
  if unknown:
    raise ValueError(f"unexpected tensors in {hf_dir} (e.g. {unknown[:3]}); config and weights disagree")
  return cfg, params


def export_hf(cfg: ModelConfig, params, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes config.json and float32 safetensors shards (plus the index json when more than one)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg), f, indent=2)
  params = _unbox(params)
  plan = tensor_plan(cfg)
  shards, size = [[]], 0
  for entry in plan:
    nbytes = 4 * int(np.prod(entry[3]))
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  names = ["model.safetensors"] if len(shards) == 1 else \
      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

  def tensors(shard):
    for name, path, layer, shape in shard:
      w = _get(params, path)
      w = w if layer is None else w[layer]  # slices one layer (a jax array transfers just that)
      yield name, to_hf(name, np.asarray(w, np.float32))

  for fname, shard in zip(names, shards):
    _write_safetensors(os.path.join(out_dir, fname), [(n, hf_shape(n, s)) for n, _, _, s in shard], tensors(shard))
  if len(shards) > 1:
    weight_map = {name: fname for fname, shard in zip(names, shards) for name, *_ in shard}
    total = sum(4 * int(np.prod(s)) for *_, s in plan)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_pretrained(path: str):
  """(cfg, params, apply_fn) from a HF Llama directory; apply_fn(params, tokens_BL) -> logits_BLV."""
  cfg, params = import_hf(path)
  model = Transformer(cfg)
  return cfg, params, lambda p, tokens_BL: model.apply({"params": p}, tokens_BL)


def _read_tensor(handle, path: str, name: str) -> np.ndarray:
  """One tensor as numpy; bfloat16, which safetensors' numpy backend cannot name, is memory-mapped."""
  if handle.get_slice(name).get_dtype() != "BF16":
    return handle.get_tensor(name)
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    entry = json.loads(f.read(n))[name]
  begin, end = entry["data_offsets"]
  w = np.memmap(path, np.uint16, "r", offset=8 + n + begin, shape=((end - begin) // 2,))
  return np.asarray(w.view(jnp.bfloat16).reshape(entry["shape"]), np.float32)


def _write_safetensors(path: str, header_entries, tensors) -> None:
  """The safetensors format (u64 header size, JSON header, raw little-endian bytes), written one
  tensor at a time so only one tensor is ever in memory. `header_entries`: (name, shape) in order."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in header_entries:
    nbytes = 4 * int(np.prod(shape))
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path + ".tmp", "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for name, w in tensors:
      assert list(w.shape) == header[name]["shape"], (name, w.shape, header[name]["shape"])
      f.write(np.ascontiguousarray(w, "<f4").tobytes())
  os.replace(path + ".tmp", path)


def _unbox(tree):
  return jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, tree,
                      is_leaf=lambda x: hasattr(x, "unbox"))


def _get(tree, path):
  for key in path:
    if key not in tree:
      return None
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
