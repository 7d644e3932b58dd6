"""Streaming conversion between HF Llama / Mixtral / BERT (masked LM) checkpoints and jaxtrain's
Orbax checkpoints, and inspection. BERT (config.json's model_type) goes through hf_bert.py into the
encoder (model.arch=encoder, train.task=mlm), every other model through hf.py.

Checkpoint layout and readers (tiers, steps, config, partial restore): pretrained.py.

Import checks everything it reads first (config.json, every safetensors header against its file's
size, tensor names and shapes, the tokenizer file), then builds the whole workdir in
WORKDIR.converting and renames it to WORKDIR last: a failed or interrupted conversion leaves no
WORKDIR. It writes one jaxtrain leaf at a time with Orbax partial saving (`ocp.v1.partial.save`, one
call per leaf, `ocp.v1.partial.finalize` at the end) into a step dir named like Orbax's own
temporary step dirs (`0.orbax-checkpoint-tmp`), adds `meta` and renames it to `0`. The HF tokenizer
(tokenizer.json or tokenizer.model) is copied in with the tokenizer_ref.json that sampling reads.
The state item is an ordinary OCDBT PyTree item that `ocp.args.StandardRestore` reads. Export and
`load_params` read leaves with `ocp.args.PyTreeRestore(partial_restore=True)`; inspection reads only
Orbax metadata.
"""

import dataclasses
import hashlib
import json
import os
import shutil

import ml_collections
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain.checkpoint import hf, hf_bert, safetensors_io
from jaxtrain.checkpoint.pretrained import (META, STATE, find_step, manager, model_config,
                                            params_metadata, read_config, read_json, restore_params,
                                            state_metadata, tiers)
# for callers that predate pretrained.py
from jaxtrain.checkpoint.pretrained import load_extra, load_params  # noqa: F401

FORMAT = 1
# WORKDIR.converting: the workdir being written, renamed to WORKDIR last
STAGING_SUFFIX = ".converting"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's TMP_DIR_SUFFIX; partial saves add ".partial_save"
# HF file -> data.tokenizers kind
TOKENIZER_FILES = {"tokenizer.json": "hf", "tokenizer.model": "sentencepiece"}
# shown only for a mixture-of-experts model
MOE_KEYS = ("n_experts", "top_k", "d_ff_expert", "n_shared_experts", "router", "renormalize",
            "route_scale", "dispatch", "grouped_matmul", "capacity_factor", "moe_first_dense",
            "moe_every", "aux_loss_weight", "router_z_weight", "bias_update_rate")
ROPE_SCALING_KEYS = ("rope_scaling", "rope_factor", "rope_original_max_len", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow",
                     "rope_attention_factor")  # shown only for a model with rope scaling
TRAIN_KEYS = ("train.steps", "train.batch_size", "train.seq_len", "train.seed", "optim.name",
              "optim.lr", "optim.schedule", "checkpoint.every_steps", "checkpoint.dir",
              "checkpoint.fast_dir", "data.kind", "data.tokenizer")


# ---- HF -> jaxtrain ----

def from_hf(hf_dir: str, workdir: str, dtype: str = "float32") -> str:
  """Converts a HF Llama or Mixtral directory into a new workdir (config.json, checkpoints/0), one
  leaf at a time; returns the step dir. All input is checked before anything is written; the workdir
  is written as WORKDIR.converting and renamed last, so a failed or interrupted conversion leaves no
  WORKDIR."""
  model, tokenizer = read_hf(hf_dir), hf_tokenizer(hf_dir)
  check_target(workdir)
  staging = os.path.abspath(workdir) + STAGING_SUFFIX
  shutil.rmtree(staging, ignore_errors=True)  # left by a conversion that was killed
  try:
    os.makedirs(staging)
    write_workdir(hf_dir, model, tokenizer, staging, os.path.abspath(workdir), dtype)
    os.rename(staging, workdir)  # onto an absent or empty dir
  except BaseException as e:
    shutil.rmtree(staging, ignore_errors=True)
    if isinstance(e, (ValueError, OSError)) and not isinstance(e, config_lib.ConfigError):
      raise config_lib.ConfigError(
          f"convert --from_hf {hf_dir} --to {workdir}: {e}".splitlines()[0]) from e
    raise
  return os.path.join(workdir, "checkpoints", "0")


def read_hf(hf_dir: str):
  """The ModelConfig of a HF directory, once its config.json, every safetensors header (against its
  file's size) and every tensor name and shape are checked; ConfigError (one line) otherwise."""
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise config_lib.ConfigError(
        f"--from_hf: {hf_dir} has no config.json (expected a HF Llama, Mixtral or BERT directory)")
  try:
    reader = hf_bert if hf_bert.is_bert(hf_dir) else hf
    model = reader.read_config(hf_dir)
    index = safetensors_io.tensor_index(hf_dir)
    reader.check_tensors(model, hf_bert.aliased(index) if reader is hf_bert else index, hf_dir)
  except (ValueError, OSError) as e:
    raise config_lib.ConfigError(f"--from_hf: {e}") from e
  return model


def check_target(workdir: str) -> None:
  """ConfigError (one line) unless --to is absent or an empty directory,
  in a directory we may write."""
  if os.path.lexists(workdir) and not os.path.isdir(workdir):
    raise config_lib.ConfigError(f"--to: {workdir} is not a directory")
  if os.path.isdir(workdir) and os.listdir(workdir):
    raise config_lib.ConfigError(f"--to: {workdir} is not empty; choose a new workdir")
  parent = os.path.dirname(os.path.abspath(workdir))
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise config_lib.ConfigError(f"--to: {parent} is not a directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise config_lib.ConfigError(f"--to: cannot write in {parent}")


def hf_tokenizer(hf_dir: str) -> str | None:
  """The tokenizer file of a HF directory (tokenizer.json before tokenizer.model), or None;
  ConfigError (one line) for one that its library cannot load."""
  import sentencepiece
  import tokenizers
  loaders = {"hf": tokenizers.Tokenizer.from_file,
             "sentencepiece": lambda path: sentencepiece.SentencePieceProcessor(model_file=path)}
  for name, kind in TOKENIZER_FILES.items():
    path = os.path.join(hf_dir, name)
    if os.path.isfile(path):
      try:
        loaders[kind](path)
      except Exception as e:  # noqa: BLE001 (both bindings raise bare Exception/RuntimeError)
        why = (str(e) or repr(e)).splitlines()[0]
        raise config_lib.ConfigError(
            f"--from_hf: {path} does not load ({why}); remove it to convert without "
            "a tokenizer") from None
      return path
  return None


def write_workdir(hf_dir: str, model, tokenizer: str | None, root: str, final_root: str,
                  dtype: str) -> None:
  """ROOT/config.json, the tokenizer and the step ROOT/checkpoints/0, one leaf at a time (ROOT will
  be renamed to FINAL_ROOT); the step is Orbax's partial save into a staging step dir, renamed when
  complete."""
  import orbax.checkpoint as ocp
  tier = os.path.join(root, "checkpoints")
  final, staging = os.path.join(tier, "0"), os.path.join(tier, "0" + TMP_SUFFIX)
  ref = carry_tokenizer(tokenizer, root)
  cfg = workdir_config(model, dtype, tokenizer and
                       os.path.join(final_root, os.path.basename(tokenizer)))
  os.makedirs(tier)
  _write_text(os.path.join(root, "config.json"), cfg.to_json(indent=2))
  context = ocp.v1.Context()
  context.memory.deepcopy_host_arrays = False  # each save blocks until written: no copy needed
  # Without zstd, TensorStore writes the leaf's bytes as they are; with it, compressed buffers of
  # the whole-leaf chunk came on top (peak 3.5-4.5x the largest leaf instead of 1x + a fixed ~65
  # MiB, benchmarks/convert_memory.py). Weights barely compress; restore reads either codec.
  context.array.saving.use_compression = False
  with context:
    for path, leaf in interop(model).read_leaves(hf_dir, model, _np_dtype(dtype)):
      save_leaf(staging, path, leaf)
      del leaf
    ocp.v1.partial.finalize(staging)
  _commit(staging, final, {"format": FORMAT, "config": cfg.to_dict(), "tokenizer": ref})


def workdir_config(model, dtype: str, tokenizer: str | None) -> ml_collections.ConfigDict:
  """default_config() with the model section of a HF model (a ModelConfig; MoE fields included) and
  a data section of text in the ids of `tokenizer` (its path in the workdir; "" when it has
  none)."""
  cfg = config_lib.default_config()
  values = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if f.name in cfg.model and f.name not in ("param_dtype", "compute_dtype")}
  cfg.model.update(values, param_dtype=dtype)
  cfg.data.update(kind="text", tokenizer=tokenizer or "")
  if model.arch == "encoder":  # BERT: the masked LM, its [MASK] the tokenizer's
    cfg.train.update(task="mlm", mask_token=bert_mask_token(tokenizer, model.vocab_size))
  return cfg


def bert_mask_token(tokenizer: str | None, vocab_size: int) -> int:
  """The id of a HF tokenizer.json's [MASK], or -1 (model.vocab_size - 1) without one."""
  if tokenizer is None or not tokenizer.endswith(".json"):
    return -1
  import tokenizers
  found = tokenizers.Tokenizer.from_file(tokenizer).token_to_id("[MASK]")
  return found if found is not None and found < vocab_size else -1


def interop(model):
  """The HF interop module of a ModelConfig: hf_bert for the encoder, hf for the decoder."""
  return hf_bert if model.arch == "encoder" else hf


def carry_tokenizer(path: str | None, root: str) -> dict | None:
  """Copies a HF tokenizer file into the workdir ROOT and writes ROOT/tokenizer_ref.json, which
  jaxtrain.data's make_tokenizer reads (data/tokenizers.py save_reference's format: a spec with a
  path relative to the workdir, and sha256(kind + file bytes)[:16]); returns it (None without a
  tokenizer)."""
  if path is None:
    return None
  name = os.path.basename(path)
  kind = TOKENIZER_FILES[name]
  shutil.copyfile(path, os.path.join(root, name))
  digest = hashlib.sha256(kind.encode())
  with open(os.path.join(root, name), "rb") as f:
    digest.update(f.read())
  ref = {"spec": {"kind": kind, "path": name}, "fingerprint": digest.hexdigest()[:16]}
  _write_text(os.path.join(root, "tokenizer_ref.json"), json.dumps(ref, indent=2))
  return ref


def save_leaf(staging: str, path: tuple, leaf) -> None:
  """One leaf into the partial save session at `staging` (blocks until it is written)."""
  import orbax.checkpoint as ocp
  ocp.v1.partial.save(staging, _nest(("params",) + path, leaf))


def _commit(staging: str, final: str, meta: dict) -> None:
  """Adds the meta item to a finalized staging step, names its items' handlers as a
  CheckpointManager save would, and renames it to the step dir (the one visible change)."""
  import orbax.checkpoint as ocp
  from etils import epath
  os.makedirs(os.path.join(staging, META))
  ocp.JsonCheckpointHandler().save(epath.Path(staging) / META, args=ocp.args.JsonSave(meta))
  # The partial saver records its own v1 handler; a manager restoring without args needs these.
  step_meta_path = os.path.join(staging, "_CHECKPOINT_METADATA")
  step_meta = read_json(step_meta_path)
  step_meta["item_handlers"] = {STATE: ocp.StandardCheckpointHandler().typestr(),
                                META: ocp.JsonCheckpointHandler().typestr()}
  _write_text(step_meta_path, json.dumps(step_meta))
  os.rename(staging, final)


# ---- jaxtrain -> HF ----

def to_hf(src: str, out_dir: str, step: int | None = None, dtype: str = "float32",
          max_shard_bytes: int = 5 * 2**30) -> str:
  """Writes the params of a workdir's or tier's newest step (or `step`) as a HF Llama directory (a
  Mixtral one for an MoE model; refused when Mixtral cannot express it), one leaf at a time;
  returns out_dir."""
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise config_lib.ConfigError(f"--to_hf: {out_dir} is not empty")
  mngr, step = find_step(src, step)
  cfg = read_config(src, mngr, step)
  if cfg.train.get("task") == "vlm":
    raise config_lib.ConfigError(
        f"--to_hf: {mngr.directory}/{step} is a vlm run (image encoder, projector, decoder); export "
        "to a Hugging Face vision-language model (LLaVA) is not built")
  model = model_config(cfg, mngr, step)
  try:
    interop(model).config_to_hf(model, dtype)
  except ValueError as e:
    raise config_lib.ConfigError(f"--to_hf: {mngr.directory}/{step}: {e}") from None
  if cfg.model.get("lora_rank"):  # a LoRA run's params are adapters: its merged weights, whole
    merged = load_params(src, step)[1]
    leaf_fn = lambda path: hf.get_at(merged, path)  # noqa: E731
  else:
    leaf_fn = _leaf_reader(mngr, step, model)

  interop(model).write_hf(model, out_dir, leaf_fn, dtype, max_shard_bytes)
  tokenizer = cfg.data.tokenizer
  name = {".json": "tokenizer.json",
          ".model": "tokenizer.model"}.get(os.path.splitext(tokenizer)[1])
  if name and os.path.isfile(tokenizer):
    shutil.copyfile(tokenizer, os.path.join(out_dir, name))
  return out_dir


def _leaf_reader(mngr, step: int, model):
  """path -> that leaf of the step's params, read alone; the shapes checked against `model`
  first."""
  meta = params_metadata(mngr, step)
  for path, shape, _ in interop(model).leaf_plan(model):
    saved = hf.get_at(meta, path)
    if saved is None or tuple(saved.shape) != tuple(shape):
      raise config_lib.ConfigError(
          f"{mngr.directory}/{step}: params/{'/'.join(path)} is "
          f"{None if saved is None else saved.shape}, the config says {shape}")
  return lambda path: hf.get_at(restore_params(mngr, step, _nest(path, hf.get_at(meta, path))),
                                path)


# ---- inspection ----

def describe(src: str, step: int | None = None) -> str:
  """A report of src's tiers (complete steps with sizes, temporary dirs) and of one step: the state
  item's tree from Orbax metadata (no array is read), parameter totals and the config."""
  lines, kinds = [], set()
  for name, tier in tiers(src):
    entries = _tier_entries(tier)
    kinds |= {kind for *_, kind in entries}
    lines.append(f"tier {name}: {tier}")
    lines += [f"  {entry:<14} {_human(size):>10}  {kind}"
              for entry, size, kind in entries] or ["  (empty)"]
  if not kinds - {"not a step"}:
    raise config_lib.ConfigError(
        f"{src}: no checkpoints (looked in {', '.join(t for _, t in tiers(src))})")
  if step is None and "complete" not in kinds:
    return "\n".join(lines + ["no complete step"])
  mngr, step = find_step(src, step)
  lines.append(f"step {step} in {mngr.directory}; state item:")
  leaves = sorted(_flat(state_metadata(mngr, step)), key=lambda item:
                  (item[0][0] != "params", item[0]))
  width = max(len("/".join(path)) for path, _ in leaves)
  totals = {"params": [0, 0], "state": [0, 0]}
  for path, leaf in leaves:
    shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
    sharding = getattr(leaf, "sharding", None)
    spec = f"  {_sharding_text(sharding)}" if sharding is not None else ""
    lines.append(
        f"  {'/'.join(path):<{width}}  {str(list(shape)):<16} {dtype or type(leaf).__name__}{spec}")
    for key in ("state", "params") if path[0] == "params" else ("state",):
      totals[key][0] += int(np.prod(shape))
      totals[key][1] += int(np.prod(shape)) * (np.dtype(dtype).itemsize if dtype is not None else 0)
  lines.append(f"params: {totals['params'][0]:,} ({_human(totals['params'][1])}); "
               f"state item: {len(leaves)} arrays, {totals['state'][0]:,} values "
               f"({_human(totals['state'][1])})")
  cfg = read_config(src, mngr, step)
  model = {k: v for k, v in cfg.model.items() if (cfg.model.get("n_experts") or k not in MOE_KEYS)
           and (cfg.model.get("rope_scaling", "none") != "none" or k not in ROPE_SCALING_KEYS)}
  lines.append("model: " + " ".join(f"{k}={v}" for k, v in model.items()))
  lines.append("train: " + " ".join(f"{k}={_lookup(cfg, k)}"
                                    for k in TRAIN_KEYS if _lookup(cfg, k) is not None))
  return "\n".join(lines)


def _tier_entries(tier: str) -> list[tuple[str, int, str]]:
  """(name, bytes on disk, kind) of every entry of a tier dir, in step order."""
  if not os.path.isdir(tier):
    return []
  complete = {str(s) for s in manager(tier).all_steps()}
  out = []
  for entry in sorted(os.listdir(tier), key=_step_order):
    full = os.path.join(tier, entry)
    temporary = TMP_SUFFIX in entry or ".partial_save" in entry
    kind = "complete" if entry in complete else \
        "temporary (Orbax tmp / partial save)" if temporary else \
        "incomplete (not finalized)" if entry.isdigit() else "not a step"
    out.append((entry, _du(full), kind))
  return out


def _sharding_text(sharding) -> str:
  """The saved sharding of an array: its mesh axes and partition spec when it is a NamedSharding."""
  spec = getattr(sharding, "partition_spec", None)
  if spec is None:
    return type(sharding).__name__
  axes = ",".join(f"{a}={n}" for a, n in zip(sharding.axis_names, np.ravel(sharding.shape))
                  if n > 1)
  return f"P{tuple(spec)} mesh({axes})"


# ---- small pieces ----

def _np_dtype(name: str):
  import jax.numpy as jnp
  return {"float32": np.float32, "bfloat16": jnp.bfloat16}[name]


def _nest(path: tuple, value) -> dict:
  for key in reversed(path):
    value = {key: value}
  return value


def _flat(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flat(v, prefix + (str(k),))
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      yield from _flat(v, prefix + (str(i),))
  elif tree is not None:
    yield prefix, tree


def _lookup(cfg, dotted):
  node = cfg
  for key in dotted.split("."):
    if key not in node:
      return None
    node = node[key]
  return node


def _du(path: str) -> int:
  if os.path.isfile(path):
    return os.path.getsize(path)
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _human(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024


def _step_order(name: str):
  head = name.split(".")[0]
  return (int(head), name) if head.isdigit() else (float("inf"), name)


def _write_text(path: str, text: str) -> None:
  """Written whole or not at all."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
