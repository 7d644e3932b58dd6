"""`convert` (HF <-> jaxtrain checkpoint, streamed leaf by leaf), `inspect` and load_pretrained(workdir)
against transformers' LlamaForCausalLM, logits to 1e-4."""

import json
import os
import shutil
import struct
import tracemalloc
import weakref

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax.serialization  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxtrain import ConfigError, __main__ as cli  # noqa: E402
from jaxtrain.checkpoint import convert, hf, pretrained  # noqa: E402
from jaxtrain import builder  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402
from jaxtrain.train import workdir as workdir_lib  # noqa: E402
from tests.fixtures import tiny_config  # noqa: E402
from tests.checkpoint.test_hf import bpe_tokenizer_json, from_pretrained, hf_logits, hf_model  # noqa: E402

torch.set_grad_enabled(False)
TOKENS_BL = np.random.default_rng(0).integers(0, 128, (2, 24)).astype(np.int32)


def run(capsys, *argv):
  """(exit status, stdout, stderr) of `python -m jaxtrain ARGV`, run in this process."""
  rc = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return rc, out, err


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """A random HF Llama (GQA, untied, rope_theta 12345) with a tokenizer.json, converted to a workdir."""
  root = tmp_path_factory.mktemp("convert")
  model = hf_model(tie=False)
  model.save_pretrained(root / "hf", safe_serialization=True)
  bpe_tokenizer_json(root / "hf" / "tokenizer.json")
  assert cli.main(["convert", "--from_hf", str(root / "hf"), "--to", str(root / "wd")]) == 0
  return root, model


def test_import_gives_transformers_logits(converted):
  root, model = converted
  want = hf_logits(model, TOKENS_BL)
  for path in (root / "wd", root / "wd" / "checkpoints"):  # a workdir, a tier dir
    cfg, params, apply_fn = pretrained.load_pretrained(str(path))
    assert (cfg.rope_theta, cfg.tie_embeddings, cfg.n_kv_heads, cfg.head_dim) == (12345.0, False, 2, 16)
    assert np.abs(np.asarray(apply_fn(params, TOKENS_BL)) - want).max() < 1e-4
  saved = json.loads((root / "wd" / "config.json").read_text())
  assert saved["model"]["rope_theta"] == 12345.0 and saved["model"]["n_layers"] == 2
  assert (saved["data"]["kind"], saved["data"]["tokenizer"]) == ("text", str(root / "wd" / "tokenizer.json"))


def test_converted_state_restores_with_standard_restore_into_shardings(converted):
  """The state item is a plain Orbax PyTree: StandardRestore reads it straight into fsdp shardings."""
  root, _ = converted
  cfg = workdir_lib.load_config(str(root / "wd"))
  cfg.mesh.update(data=1, fsdp=-1)
  mesh, task, tx, _ = builder.build(cfg)
  shardings = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules).params
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state_lib.abstract_state(task, tx).params, shardings)
  mngr = ocp.CheckpointManager(str(root / "wd" / "checkpoints"), item_names=("state", "meta"))
  assert mngr.all_steps() == [0]
  got = mngr.restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore({"params": abstract})))["state"]
  meta = mngr.restore(0, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  assert meta["format"] == 1 and meta["config"]["model"]["d_ff"] == 96
  assert meta["tokenizer"] == json.loads((root / "wd" / "tokenizer_ref.json").read_text())
  assert meta["tokenizer"]["spec"] == {"kind": "hf", "path": "tokenizer.json"}
  _, want = hf.import_hf(str(root / "hf"))
  q = got["params"]["layers"]["attn"]["q"]
  assert q.sharding == shardings["layers"]["attn"]["q"] and not q.sharding.is_fully_replicated
  for path in [("embed",), ("unembed",), ("layers", "attn", "q"), ("layers", "mlp", "down")]:
    np.testing.assert_array_equal(np.asarray(hf.get_at(got["params"], path)), hf.get_at(want, path))


def test_export_loads_in_transformers(converted, capsys):
  root, model = converted
  rc, out, _ = run(capsys, "convert", "--from", root / "wd", "--to_hf", root / "out")
  assert rc == 0 and str(root / "out") in out
  assert sorted(os.listdir(root / "out")) == ["config.json", "model.safetensors", "tokenizer.json"]
  want = hf_logits(model, TOKENS_BL)
  assert np.abs(hf_logits(from_pretrained(root / "out"), TOKENS_BL) - want).max() < 1e-4


def test_bfloat16_both_ways(converted, capsys, tmp_path):
  root, model = converted
  os.makedirs(tmp_path / "wd")  # an empty --to is fine
  assert run(capsys, "convert", "--from_hf", root / "hf", "--to", tmp_path / "wd", "--dtype", "bfloat16")[0] == 0
  q_line = next(line for line in run(capsys, "inspect", tmp_path / "wd")[1].splitlines() if "attn/q " in line)
  assert q_line.split()[-1] == "bfloat16"
  _, params = convert.load_params(str(tmp_path / "wd"))
  q = model.model.layers[1].self_attn.q_proj.weight.to(torch.bfloat16).float().numpy()
  np.testing.assert_array_equal(params["layers"]["attn"]["q"][1].astype(np.float32), q.T.reshape(64, 4, 16))
  assert run(capsys, "convert", "--from", tmp_path / "wd", "--to_hf", tmp_path / "out", "--dtype", "bfloat16")[0] == 0
  back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
  assert back.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
  np.testing.assert_array_equal(back.model.layers[1].self_attn.q_proj.weight.float().numpy(), q)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir with training checkpoints (sharded params, optimizer state) in two tiers, saved as
  train saves them: steps 3 and 5 in WORKDIR/checkpoints, step 7 in the fast tier."""
  root = tmp_path_factory.mktemp("trained")
  cfg = tiny_config(mesh={"data": 2, "fsdp": -1})
  cfg.checkpoint.fast_dir = str(root / "fast")
  mesh, task, tx, _ = builder.build(cfg)
  abstract = state_lib.abstract_state(task, tx)
  shardings = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules)
  os.makedirs(root / "wd")
  (root / "wd" / "config.json").write_text(cfg.to_json(indent=2))
  params = {}
  for step, tier in [(3, root / "wd" / "checkpoints"), (5, root / "wd" / "checkpoints"), (7, root / "fast")]:
    rng = np.random.default_rng(step)  # random values (norm scales too), placed in their shardings
    random = lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype) if x.dtype == np.float32 \
        else np.zeros(x.shape, x.dtype)
    state = jax.tree.map(lambda x, s: jax.device_put(random(x), s), abstract, shardings)
    mngr = ocp.CheckpointManager(str(tier), item_names=("state", "meta"))
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(flax.serialization.to_state_dict(state)),
        meta=ocp.args.JsonSave({"format": 1, "config": cfg.to_dict(), "tokenizer": None})))
    mngr.wait_until_finished()
    params[step] = jax.device_get(state.params)
  os.makedirs(root / "wd" / "checkpoints" / "9.orbax-checkpoint-tmp-123")  # a save cut short
  return root, task.model, params


def test_export_from_training_checkpoint_newest_step_of_any_tier(trained, capsys):
  root, model, states = trained
  tokens_BL = TOKENS_BL % 64
  for step, out in [(None, root / "out_newest"), (5, root / "out_5")]:
    argv = ["convert", "--from", root / "wd", "--to_hf", out] + ([] if step is None else ["--step", step])
    assert run(capsys, *argv)[0] == 0
    want = np.asarray(model.apply({"params": states[step or 7]}, tokens_BL))
    assert np.abs(hf_logits(from_pretrained(out), tokens_BL) - want).max() < 1e-4
  convert.to_hf(str(root / "fast"), str(root / "out_sharded"), max_shard_bytes=20_000)
  with open(root / "out_sharded" / "model.safetensors.index.json") as f:
    assert len(set(json.load(f)["weight_map"].values())) > 2
  want = np.asarray(model.apply({"params": states[7]}, tokens_BL))
  assert np.abs(hf_logits(from_pretrained(root / "out_sharded"), tokens_BL) - want).max() < 1e-4


def test_inspect_training_workdir(trained, capsys):
  root, _, states = trained
  rc, out, _ = run(capsys, "inspect", root / "wd")
  assert rc == 0
  lines = out.splitlines()
  for step in ("3", "5", "7"):
    assert any(line.split()[0] == step and line.split()[-1] == "complete" for line in lines)
  assert any("9.orbax-checkpoint-tmp-123" in line and "temporary" in line for line in lines)
  assert f"step 7 in {root / 'fast'}" in out
  q = next(line for line in lines if line.split()[0] == "params/layers/attn/q").split()
  assert q[1:5] == ["[2,", "32,", "4,", "8]"] and q[5] == "float32" and "fsdp" in " ".join(q[6:])
  assert any(line.startswith("  opt_state/inner_state/") for line in lines)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(states[7]))
  assert f"params: {n:,} ({4 * n / 1024:.1f} KiB)" in out
  assert "d_model=32" in out and "train.steps=4" in out
  assert f"step 3 in {root / 'wd' / 'checkpoints'}" in run(capsys, "inspect", root / "wd", "--step", 3)[1]


def test_inspect_converted(converted, capsys):
  root, _ = converted
  rc, out, _ = run(capsys, "inspect", root / "wd" / "checkpoints")
  assert rc == 0 and "step 0 in" in out
  assert "params/layers/mlp/down" in out and "[2, 96, 64]" in out and "rope_theta=12345.0" in out
  assert "opt_state" not in out and "rope_factor" not in out  # rope scaling keys only for a scaled model


@pytest.mark.parametrize("argv", [
    ["convert", "--from_hf", "/nonexistent", "--to", "{tmp}/wd"],
    ["convert", "--from", "/nonexistent", "--to_hf", "{tmp}/out"],
    ["convert", "--from_hf", "{root}/hf"],
    ["convert", "--from", "{root}/wd", "--to", "{tmp}/x"],
    ["convert", "--from_hf", "{root}/hf", "--to", "{root}/wd"],  # already holds a checkpoint
    ["convert", "--from_hf", "{root}/hf", "--to", "{root}/wd/config.json"],  # a file
    ["convert", "--from", "{root}/wd", "--to_hf", "{root}/hf"],  # not empty
    ["convert", "--from", "{root}/wd", "--to_hf", "{tmp}/out", "--step", "4"],
    ["convert", "--from", "{root}/hf", "--to_hf", "{tmp}/out"],  # a HF dir is no checkpoint
    ["convert", "--from_hf", "{root}/wd", "--to", "{tmp}/wd"],  # a workdir is no HF dir
    ["convert", "--from_hf", "{root}/hf", "--to", "{tmp}/wd", "--dtype", "float16"],
    ["inspect", "/nonexistent"],
    ["inspect", "{tmp}"],
    ["inspect", "{root}/hf"],
    ["inspect", "{root}/wd", "--step", "4"],
])
def test_bad_paths_exit_2_with_one_line(converted, capsys, tmp_path, argv):
  root, _ = converted
  rc, out, err = run(capsys, *[a.format(root=root, tmp=tmp_path) for a in argv])
  assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err


@pytest.mark.parametrize("where", ["4th leaf", "after finalize"])
def test_interrupted_conversion_leaves_no_workdir(converted, capsys, tmp_path, monkeypatch, where):
  """Interrupted while saving leaves, or after Orbax finalized the staging step but before it was
  renamed: neither --to nor its staging dir is left; a staging dir left by a killed one is replaced."""
  root, model = converted
  name, fails = {"4th leaf": ("save_leaf", lambda calls, args: len(calls) == 4),
                 "after finalize": ("_write_text", lambda calls, args: args[0].endswith("_CHECKPOINT_METADATA"))}[where]
  real, calls = getattr(convert, name), []

  def dies(*args):
    calls.append(args)
    if fails(calls, args):
      raise KeyboardInterrupt
    return real(*args)

  monkeypatch.setattr(convert, name, dies)
  with pytest.raises(KeyboardInterrupt):
    cli.main(["convert", "--from_hf", str(root / "hf"), "--to", str(tmp_path / "wd")])
  assert os.listdir(tmp_path) == []
  with pytest.raises(ConfigError, match="no such directory"):
    pretrained.load_pretrained(str(tmp_path / "wd"))
  monkeypatch.setattr(convert, name, real)
  killed = tmp_path / "wd.converting" / "checkpoints" / "0.orbax-checkpoint-tmp"  # as a SIGKILL leaves it
  os.makedirs(killed)
  (killed / "junk").write_text("half")
  assert run(capsys, "convert", "--from_hf", root / "hf", "--to", tmp_path / "wd")[0] == 0  # reruns cleanly
  assert sorted(os.listdir(tmp_path)) == ["wd"] and sorted(os.listdir(tmp_path / "wd" / "checkpoints")) == ["0"]
  cfg, params, apply_fn = pretrained.load_pretrained(str(tmp_path / "wd"))
  assert np.abs(np.asarray(apply_fn(params, TOKENS_BL)) - hf_logits(model, TOKENS_BL)).max() < 1e-4


def random_llama(path, n_layers=8, d=256, vocab=1024, seed=0):
  """A random HF Llama directory written with numpy: every leaf is [n_layers, 256, 256] (2 MiB)
  or smaller, the model ~8x that."""
  rng = np.random.default_rng(seed)
  config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": d, "num_hidden_layers": n_layers,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": d, "tie_word_embeddings": False}
  tensors = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
  for i in range(n_layers):
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
      tensors[f"model.layers.{i}.{name}.weight"] = (d, d)
    tensors[f"model.layers.{i}.input_layernorm.weight"] = (d,)
    tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = (d,)
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  save_file({k: rng.standard_normal(s, np.float32) for k, s in tensors.items()},
            os.path.join(path, "model.safetensors"))
  return sum(4 * int(np.prod(s)) for s in tensors.values()), 4 * n_layers * d * d


def test_conversion_holds_one_leaf_at_a_time(tmp_path, monkeypatch):
  """Both directions: no earlier leaf is alive when the next one is written, and the Python/numpy
  peak (tracemalloc, after a first conversion did the lazy imports) stays near the largest leaf while
  the model is 8x larger. (tracemalloc does not see buffers TensorStore allocates: the RSS of whole
  conversions is measured by benchmarks/convert_memory.py.)"""
  total, largest = random_llama(str(tmp_path / "hf"))
  assert total > 7 * largest
  alive = []

  def watch(arrays):
    leaked = [r for r in alive if r() is not None]
    assert not leaked, f"{len(leaked)} earlier leaves still alive"
    alive.extend(weakref.ref(a) for a in arrays)

  real_save, real_restore = convert.save_leaf, convert.restore_params
  monkeypatch.setattr(convert, "save_leaf", lambda staging, path, leaf: (watch([leaf]), real_save(staging, path, leaf)))
  monkeypatch.setattr(convert, "restore_params", lambda mngr, step, tree: (
      lambda out: (watch(jax.tree.leaves(out)), out)[1])(real_restore(mngr, step, tree)))
  peaks = {}
  for name, convert_fn in [("first import", lambda: convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "wd0"))),
                           ("export", lambda: convert.to_hf(str(tmp_path / "wd0"), str(tmp_path / "out"))),
                           ("import", lambda: convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "wd")))]:
    alive.clear()
    tracemalloc.start()
    convert_fn()
    peaks[name] = tracemalloc.get_traced_memory()[1] / largest
    tracemalloc.stop()
    assert len(alive) == 12
  assert peaks["import"] < 2 and peaks["export"] < 2, peaks
  _, want = hf.import_hf(str(tmp_path / "hf"))
  _, got = hf.import_hf(str(tmp_path / "out"))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)


def tree_snapshot(path) -> dict:
  """{relative path: bytes, or None for a dir} of everything under path."""
  out = {}
  for d, dirs, files in os.walk(path):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), path)] = None
    for name in files:
      with open(os.path.join(d, name), "rb") as f:
        out[os.path.relpath(os.path.join(d, name), path)] = f.read()
  return out


def cut(path, keep):
  """Truncates the file at `path` to `keep(size)` bytes."""
  with open(path, "r+b") as f:
    f.truncate(keep(os.path.getsize(path)))


def set_header(path, edit):
  """Rewrites a safetensors file's JSON header with edit(header) (same data bytes)."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header, data = json.loads(f.read(n)), f.read()
  blob = json.dumps(edit(header)).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob + data)


def shift_offsets(header):
  name = next(k for k in header if k != "__metadata__")
  header[name]["data_offsets"][1] -= 4
  return header


BREAKS = {  # what goes wrong in a HF dir: how to do it to a copy of one
    "cut short": lambda d: cut(d / "model.safetensors", lambda size: size - 100),
    "0-byte safetensors": lambda d: cut(d / "model.safetensors", lambda size: 0),
    "4-byte safetensors": lambda d: cut(d / "model.safetensors", lambda size: 4),
    "header past the end": lambda d: cut(d / "model.safetensors", lambda size: 200),
    "header not JSON": lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{" + bytes(64)),
    "header a list": lambda d: set_header(d / "model.safetensors", lambda h: [h]),
    "offsets disagree with shape": lambda d: set_header(d / "model.safetensors", shift_offsets),
    "unknown dtype": lambda d: set_header(d / "model.safetensors", lambda h: {
        k: {**v, "dtype": "I4"} if k != "__metadata__" else v for k, v in h.items()}),
    "index names a missing shard": lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})),
    "index not JSON": lambda d: (d / "model.safetensors.index.json").write_text("{"),
    "config.json a list": lambda d: (d / "config.json").write_text("[1, 2]"),
    "config.json not JSON": lambda d: (d / "config.json").write_text("{'model_type': 'llama'"),
    "config.json binary": lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00"),
    "field of the wrong type": lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "num_hidden_layers": "2"})),
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_broken_hf_dir_is_one_line_exit_2_and_writes_nothing(converted, capsys, tmp_path, broken):
  root, _ = converted
  shutil.copytree(root / "hf", tmp_path / "hf")
  BREAKS[broken](tmp_path / "hf")
  rc, out, err = run(capsys, "convert", "--from_hf", tmp_path / "hf", "--to", tmp_path / "wd")
  assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no --to, no staging dir beside it


TARGETS = {  # a --to that convert must refuse, leaving it as it was
    "non-JSON config.json in it": lambda t: (os.makedirs(t / "wd"), (t / "wd" / "config.json").write_text("{x")),
    "another run's config.json in it": lambda t: (os.makedirs(t / "wd"), (t / "wd" / "config.json").write_text(
        json.dumps(tiny_config().to_dict()))),
    "a file in it": lambda t: (os.makedirs(t / "wd"), (t / "wd" / "notes.txt").write_text("mine")),
    "a regular file": lambda t: (t / "wd").write_text("mine"),
    "under a regular file": lambda t: (t / "file").write_text("mine"),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_bad_target_is_one_line_exit_2_and_left_as_it_was(converted, capsys, tmp_path, target):
  root, _ = converted
  TARGETS[target](tmp_path)
  before = tree_snapshot(tmp_path)
  to = tmp_path / ("file/wd" if target == "under a regular file" else "wd")
  rc, out, err = run(capsys, "convert", "--from_hf", root / "hf", "--to", to)
  assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
  assert tree_snapshot(tmp_path) == before


def test_inspect_workdir_without_config_json_lists_its_steps(trained, capsys, tmp_path):
  """The config saved in the steps is the truth: WORKDIR/checkpoints is listed, and the fast tier its
  newest step's config names."""
  root, model, states = trained
  shutil.copytree(root / "wd", tmp_path / "wd")
  os.remove(tmp_path / "wd" / "config.json")
  rc, out, err = run(capsys, "inspect", tmp_path / "wd")
  assert rc == 0 and err == "", err
  lines = out.splitlines()
  assert f"tier persistent: {tmp_path / 'wd' / 'checkpoints'}" in lines and f"tier fast: {root / 'fast'}" in lines
  for step in ("3", "5", "7"):
    assert any(line.split()[0] == step and line.split()[-1] == "complete" for line in lines), out
  assert f"step 7 in {root / 'fast'}" in out and "d_model=32" in out
  _, params, apply_fn = pretrained.load_pretrained(str(tmp_path / "wd"))
  tokens_BL = TOKENS_BL % 64
  np.testing.assert_allclose(apply_fn(params, tokens_BL), model.apply({"params": states[7]}, tokens_BL), atol=1e-6)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_inspect_workdir_with_broken_config_json_is_one_line(capsys, tmp_path, text):
  (tmp_path / "config.json").write_text(text)
  rc, out, err = run(capsys, "inspect", tmp_path)
  assert rc == 2 and out == "" and err.count("\n") == 1 and "config.json" in err, err
