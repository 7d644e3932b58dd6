"""Rope scaling between Hugging Face configs and ModelConfig: `rope_scaling` (or transformers 5's
`rope_parameters`) of type linear, llama3 or yarn maps onto ModelConfig's rope_* keys; export writes
it back as `rope_scaling`, which transformers 4 and 5 read. Other types (dynamic, longrope, ...) are
refused."""

import math

from jaxtrain.model.transformer import ModelConfig

# Rope scaling: HF rope type -> ours, and the HF field of each of our rope_* keys (each type reads
# its own).
HF_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
HF_ROPE_KEYS = {"rope_factor": "factor",
                "rope_original_max_len": "original_max_position_embeddings",
                "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor", "rope_beta_fast": "beta_fast",
                "rope_beta_slow": "beta_slow", "rope_attention_factor": "attention_factor"}
ROPE_KEYS_OF = {"none": (), "linear": ("rope_factor",),
                "llama3": ("rope_factor", "rope_original_max_len", "rope_low_freq_factor",
                           "rope_high_freq_factor"),
                "yarn": ("rope_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
                         "rope_attention_factor")}

def rope_dict(hf: dict) -> dict:
  """The rope settings transformers uses: `rope_scaling` when set (it wins over `rope_parameters`),
  else `rope_parameters`."""
  return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def rope_type(rope: dict) -> str:
  return rope.get("rope_type", rope.get("type", "default"))


def check_rope(hf: dict) -> None:
  """ValueError (one line) for rope settings we do not compute as transformers does: another rope
  type, a partial rotary dim, yarn's untruncated ramp or its DeepSeek mscale pair, fields that are
  no numbers."""
  key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = rope_dict(hf)
  kind, partial = rope_type(rope), rope.get("partial_rotary_factor",
                                            hf.get("partial_rotary_factor", 1))
  if not isinstance(kind, str) or kind not in HF_ROPE_TYPES:
    raise ValueError(f"{key} rope_type {kind!r} is not supported ({', '.join(HF_ROPE_TYPES)})")
  if partial != 1:
    raise ValueError(f"{key} partial_rotary_factor={partial!r} is not supported "
                     "(only a rope over the whole head)")
  if kind == "yarn" and (rope.get("truncate", True) is not True or
                         (rope.get("mscale") and rope.get("mscale_all_dim"))):
    raise ValueError(f"{key} yarn with truncate=false or mscale/mscale_all_dim is not supported")
  for field in [HF_ROPE_KEYS[k] for k in ROPE_KEYS_OF[HF_ROPE_TYPES[kind]]]:
    value = rope.get(field)
    if value is not None and not (type(value) in (int, float) and math.isfinite(value) and
                                  value > 0):
      raise ValueError(f"{key} {field}={value!r} is not a finite number > 0")
  if kind in ("linear", "llama3") and rope.get("factor") is None:
    raise ValueError(f"{key} {kind} lacks factor")
  if kind == "llama3" and (rope.get("low_freq_factor") is None or
                           rope.get("high_freq_factor") is None):
    raise ValueError(f"{key} llama3 lacks low_freq_factor or high_freq_factor")
  if kind != "default" and not float(rope.get("original_max_position_embeddings") or
                                     1).is_integer():
    raise ValueError(
        f"{key} original_max_position_embeddings={rope['original_max_position_embeddings']!r} is "
        "not an integer")


def rope_scaling_from_hf(hf: dict, rope: dict, max_len: int) -> dict:
  """ModelConfig's rope_* keys for a checked (_check_rope) HF rope dict, with transformers'
  fallbacks: original_max_position_embeddings from the top level, else the dict, else
  max_position_embeddings; yarn's factor max_len / original when absent, beta_fast 32 and beta_slow
  1 when unset, attention_factor derived."""
  kind = HF_ROPE_TYPES[rope_type(rope)]
  top = hf.get("original_max_position_embeddings")
  original = top if top is not None else rope.get("original_max_position_embeddings") or max_len
  values = {**rope, "original_max_position_embeddings": original}
  if kind == "yarn":
    values.update(factor=max_len / original if rope.get("factor") is None else rope["factor"],
                  beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
                  attention_factor=rope.get("attention_factor") or 0.0)
  return {"rope_scaling": kind,
          **{ours: (int if ours == "rope_original_max_len" else float)(values[HF_ROPE_KEYS[ours]])
             for ours in ROPE_KEYS_OF[kind]}}


def rope_scaling_to_hf(cfg: ModelConfig) -> dict | None:
  """The HF rope dict of cfg's rope scaling (rope_type and the fields its type reads), None without
  one; a yarn attention_factor of 0 is left out, so transformers derives it as we do."""
  if cfg.rope_scaling == "none":
    return None
  out = {"rope_type": cfg.rope_scaling,
         **{HF_ROPE_KEYS[k]: getattr(cfg, k)
            for k in ROPE_KEYS_OF[cfg.rope_scaling]}}
  if out.get("attention_factor") == 0:
    del out["attention_factor"]
  return out
