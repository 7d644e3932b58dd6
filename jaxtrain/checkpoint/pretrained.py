"""Reading jaxtrain checkpoints for inference: tiers and steps, the saved config, params and the
non-trainable collections (Orbax partial restore, nothing else is read), and `load_pretrained`.

A tier directory holds integer step dirs, each with the Orbax items `state` (the train state as a
dict; a converted checkpoint has only `params`), `meta` (JSON: format, config, tokenizer) and, for a
training checkpoint, `data`. Imports hf (for HF directories and the model), never convert.
"""

import dataclasses
import json
import os

import ml_collections
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain.checkpoint import hf, hf_bert

STATE, META = "state", "meta"


def tiers(src: str) -> list[tuple[str, str]]:
  """(name, dir) of the checkpoint tiers of a workdir, or [("tier", src)] when src is a tier dir
  itself. A workdir's tiers come from its config.json or, without one, from the config saved in the
  newest step of WORKDIR/checkpoints. ConfigError (one line) when src is neither, or its config.json
  is unreadable."""
  from jaxtrain.checkpoint import tier_dirs
  if not os.path.isdir(src):
    raise config_lib.ConfigError(f"{src}: no such directory")
  if hf.is_hf_dir(src):
    raise config_lib.ConfigError(
        f"{src} is a Hugging Face directory; convert it with --from_hf first")
  if os.path.isfile(os.path.join(src, "config.json")):
    dirs = tier_dirs(_workdir_config(os.path.join(src, "config.json")).get("checkpoint", {}), src)
  elif os.path.isdir(os.path.join(src, "checkpoints")):
    saved = _newest_saved_config(os.path.join(src, "checkpoints")).get("checkpoint", {})
    dirs = {**tier_dirs(saved, src),
            "persistent": os.path.join(os.path.abspath(src), "checkpoints")}
  else:
    return [("tier", src)]
  return sorted(dirs.items(), key=lambda item: item[0] != "persistent")  # persistent first


def _workdir_config(path: str) -> dict:
  """A workdir's config.json as a dict; ConfigError (one line) when it is not a JSON object."""
  try:
    cfg = read_json(path)
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise config_lib.ConfigError(f"{path} is not JSON ({str(e).splitlines()[0]})") from None
  if not isinstance(cfg, dict):
    raise config_lib.ConfigError(f"{path} is not a JSON object")
  return cfg


def _newest_saved_config(tier: str) -> dict:
  """The config saved in the meta item of a tier's newest complete step; {} when there is none."""
  mngr = manager(tier)
  steps = [s for s in mngr.all_steps() if os.path.isdir(os.path.join(mngr.directory, str(s), META))]
  return read_meta(mngr, max(steps))["config"] if steps else {}


def manager(tier: str):
  """A read-only Orbax manager over a tier, with the handlers of its items."""
  import orbax.checkpoint as ocp
  from absl import logging
  # the package's own item (a training checkpoint's data)
  from jaxtrain.checkpoint import DataStateHandler
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                         max_to_keep=None)
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)  # it warns that the directory is read-only, as asked
  try:
    return ocp.CheckpointManager(os.path.abspath(tier), options=options, item_handlers={
        STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler(),
        "data": DataStateHandler()})
  finally:
    logging.set_verbosity(verbosity)


def find_step(src: str, step: int | None = None):
  """(manager, step) of the newest complete step over all tiers of src (or of `step`)."""
  best = None
  for _, tier in tiers(src):
    if not os.path.isdir(tier):
      continue
    mngr = manager(tier)
    for s in mngr.all_steps():
      if (step is None or s == step) and (best is None or s > best[1]):
        best = (mngr, s)
  if best is None:
    what = "no complete checkpoint" if step is None else f"no complete step {step}"
    raise config_lib.ConfigError(f"{src}: {what} (looked in {', '.join(t for _, t in tiers(src))})")
  return best


def read_config(src: str, mngr, step: int) -> ml_collections.ConfigDict:
  """The config saved with the step (its `meta` item), else the workdir's config.json."""
  if os.path.isdir(os.path.join(mngr.directory, str(step), META)):
    return ml_collections.ConfigDict(read_meta(mngr, step)["config"])
  path = os.path.join(src, "config.json")
  if not os.path.isfile(path):
    raise config_lib.ConfigError(f"{src}: step {step} has no meta item and there is no config.json")
  return ml_collections.ConfigDict(read_json(path))


def read_meta(mngr, step: int) -> dict:
  """A step's meta item: format, config, tokenizer reference."""
  import orbax.checkpoint as ocp
  return mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]


def model_config(cfg, mngr, step) -> hf.ModelConfig:
  """The ModelConfig of a step's config."""
  if "model" not in cfg:
    raise config_lib.ConfigError(f"{mngr.directory}/{step}: its config has no model section")
  return hf.ModelConfig.from_config(cfg.model)


def params_metadata(mngr, step: int) -> dict:
  """The `params` subtree of the state item's Orbax metadata (shapes, dtypes; no array is read)."""
  tree = state_metadata(mngr, step)
  if not isinstance(tree, dict) or "params" not in tree:
    raise config_lib.ConfigError(f"{mngr.directory}/{step}: the state item has no params")
  return tree["params"]


def state_metadata(mngr, step: int):
  """The state item's Orbax metadata tree (no array is read)."""
  tree = mngr.item_metadata(step)[STATE]
  return getattr(tree, "tree", tree)


def restore_params(mngr, step: int, tree: dict, key: str = "params") -> dict:
  """The leaves of `tree` (a subtree of the state's `key` metadata) as numpy arrays, read with
  partial restore."""
  import jax
  import orbax.checkpoint as ocp
  item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
  restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  args = ocp.args.PyTreeRestore(item={key: item}, restore_args={key: restore_args},
                                partial_restore=True)
  return mngr.restore(step, args=ocp.args.Composite(**{STATE: args}))[STATE][key]


def read_step(src: str, step: int | None = None):
  """(config, params, extra) of a workdir's or tier's newest step (or `step`): the config saved with
  it, its params and its non-trainable model collections (TrainState.extra, e.g. MoE expert biases;
  {} for a converted model) as numpy. Partial restore: no optimizer state or data item is read."""
  mngr, step = find_step(src, step)
  cfg = read_config(src, mngr, step)
  params = _merged(cfg, restore_params(mngr, step, params_metadata(mngr, step)), mngr, step)
  return cfg, params, _extra(mngr, step)


def load_extra(src: str, step: int | None = None) -> dict:
  """The non-trainable model collections of a training checkpoint's newest step (or `step`); {} when
  it has none (a converted model)."""
  return _extra(*find_step(src, step))


def load_task_state(src: str, step: int | None = None, key: str = "") -> dict:
  """A training checkpoint's task state (TrainState.task_state; only its entry `key` when given) of
  its newest step (or `step`) as numpy; {} when it has none (a frozen vlm encoder lives there)."""
  mngr, step = find_step(src, step)
  tree = state_metadata(mngr, step)
  tree = tree.get("task_state") if isinstance(tree, dict) else None
  if tree and key:
    tree = {key: tree[key]} if key in tree else None
  return restore_params(mngr, step, tree, "task_state") if tree else {}


def _extra(mngr, step: int) -> dict:
  tree = state_metadata(mngr, step)
  extra = tree.get("extra") if isinstance(tree, dict) else None
  return restore_params(mngr, step, extra, "extra") if extra else {}


def load_params(src: str, step: int | None = None):
  """(ModelConfig, params as numpy) of a workdir's or tier's newest step (or `step`); a LoRA run's
  are its merged full weights (and its ModelConfig says lora_rank=0)."""
  mngr, step = find_step(src, step)
  saved = read_config(src, mngr, step)
  cfg = model_config(saved, mngr, step)
  params = _merged(saved, restore_params(mngr, step, params_metadata(mngr, step)), mngr, step)
  return dataclasses.replace(cfg, lora_rank=0), params


def _merged(saved, params: dict, mngr, step: int) -> dict:
  """The full weights of `step`, whose saved config is `saved`: its params, or for a LoRA run
  (model.lora_rank > 0: its params are adapters) its base (checkpoint.init_from at the step the
  run started from, its task state's lora_base_step; int8 and back with model.lora_base_bits=8, as
  the run saw it) with the adapters merged in."""
  m = saved.get("model", {})
  if not m.get("lora_rank"):
    return params
  from jaxtrain.model import lora
  task_state = state_metadata(mngr, step).get("task_state", {})
  base_step = (int(restore_params(mngr, step, {"lora_base_step": task_state["lora_base_step"]},
                                  "task_state")["lora_base_step"])
               if "lora_base_step" in task_state else None)
  _, base = load_params(saved["checkpoint"]["init_from"], base_step)
  if m.get("lora_base_bits"):  # the adapters were trained against the int8 base
    base = _numpy(lora.dequantize(lora.quantize(base)))
  merged = lora.merge(base, params, m["lora_alpha"], m["lora_rank"])
  return _numpy(merged)


def load_pretrained(path: str):
  """(cfg, params, apply_fn) from a HF Llama, Mixtral or BERT directory, or from a jaxtrain workdir or
  checkpoint tier (its newest step's params, read with Orbax partial restore); apply_fn(params,
  tokens_BL) -> logits_BLV. A trained MoE's expert biases (TrainState.extra) are bound into
  apply_fn: they choose the experts."""
  extra = {}
  if hf.is_hf_dir(path):
    cfg, params = (hf_bert if hf_bert.is_bert(path) else hf).import_hf(path)
  else:
    cfg, params = load_params(path)
    extra = load_extra(path)
  model = hf_bert.Encoder(cfg) if cfg.arch == "encoder" else hf.Transformer(cfg)
  return cfg, params, lambda p, tokens_BL: model.apply({"params": p, **extra}, tokens_BL)


def _numpy(tree):
  import jax
  return jax.tree.map(np.asarray, tree)


def read_json(path: str):
  with open(path) as f:
    return json.load(f)
