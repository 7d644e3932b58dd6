"""Configs: each file builds and shards abstractly; bad configs end with one line and status 2."""

import glob
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib, config_files
from jaxtrain.__main__ import main
from jaxtrain.model import param_count
from jaxtrain.model.vision import vision_param_count
from jaxtrain import builder
from jaxtrain.core import state as state_lib

from tests.fixtures import ROOT
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if not p.endswith("__init__.py"))
EXPECTED = {"gpt2_small": 124e6, "llama_1b": 1.24e9, "llama_8b": 8.03e9, "mixtral_8x7b": 46.7e9}
EXPECTED_ACTIVE = {"mixtral_8x7b": 12.9e9}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-3])
def test_config_builds_and_shards_abstractly(path):
  cfg = config_files.load_config_file(path)
  config_lib.validate(cfg, jax.device_count())
  mesh, task, tx, _ = builder.build(cfg)
  model = task.model
  shardings = state_lib.state_shardings(task, tx, mesh, cfg.mesh.rules)
  abstract = state_lib.abstract_state(task, tx)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
  head = sum(int(np.prod(x.shape)) for k in ("reward_head", "value_head")  # train.task rm, ppo
             for x in jax.tree.leaves(abstract.params.get(k, {})))
  vision = vision_param_count(model.cfg, model.vision) if cfg.train.task == "vlm" else 0
  assert n == param_count(model.cfg) + head + vision
  name = os.path.basename(path)[:-3]
  if name in EXPECTED:
    assert abs(n - EXPECTED[name]) / EXPECTED[name] < 0.01, n
  active = param_count(model.cfg, active=True)
  if name in EXPECTED_ACTIVE:
    assert abs(active - EXPECTED_ACTIVE[name]) / EXPECTED_ACTIVE[name] < 0.01, active
  print(f"{name}: {n / 1e6:,.1f}M parameters, {active / 1e6:,.1f}M active")
  # every parameter leaf has a sharding, and large ones are split when the preset shards params
  leaves = jax.tree.leaves(shardings.params)
  assert len(leaves) == len(jax.tree.leaves(abstract.params))
  if cfg.mesh.rules != "dp" and mesh.shape["fsdp"] > 1:
    layer = shardings.params["layers"]
    assert not (layer["mlp"] if "mlp" in layer else layer["moe"])["up"].is_fully_replicated
  if cfg.model.n_experts and cfg.mesh.rules.endswith("_ep") and mesh.shape["expert"] > 1:
    assert shardings.params["layers"]["moe"]["up"].spec[1] == "expert"  # [layers, expert, embed, mlp]


BAD = {
    "mesh does not match devices": ["--config.mesh.data=3"],
    "batch does not divide": ["--config.train.batch_size=12"],
    "heads not divisible by kv heads": ["--config.model.n_kv_heads=3"],
    "heads not divisible by tensor": ["--config.mesh.tensor=8", "--config.model.n_heads=4",
                                      "--config.model.n_kv_heads=4"],
    "sequence longer than max": ["--config.train.seq_len=512"],
    "unknown preset": ["--config.mesh.rules=zero3"],
    "unknown key": ["--config.model.n_expertz=8"],
    "bad type": ["--config.train.steps=many"],
    "unknown remat": ["--config.model.remat=some"],
    "unknown cross entropy": ["--config.train.cross_entropy=fused"],
    "cross entropy token chunk zero": ["--config.train.cross_entropy=chunked", "--config.train.ce_token_chunk=0"],
    "cross entropy vocab chunk negative": ["--config.train.ce_vocab_chunk=-8"],
    "unknown fused norm": ["--config.model.fused_norm=triton"],
    "unknown attention": ["--config.model.attention=flash"],
    "attention block zero": ["--config.model.attention=blockwise", "--config.model.attention_block=0"],
    "top_k above experts": ["--config.model.n_experts=4", "--config.model.top_k=5"],
    "experts over the expert axis": ["--config.model.n_experts=3", "--config.model.top_k=1",
                                     "--config.mesh.expert=2", "--config.mesh.rules=fsdp_ep"],
    "moe_every does not divide": ["--config.model.n_experts=4", "--config.model.moe_every=3"],
    "unknown router": ["--config.model.n_experts=4", "--config.model.router=relu"],
    "fast tier that never saves": ["--config.checkpoint.fast_dir=/tmp/x"],
    "unwritable checkpoint dir": ["--config.checkpoint.dir=/proc/jaxtrain/ckpt"],
    "adaptive min above max": ["--config.checkpoint.adaptive=true", "--config.checkpoint.adaptive_min_steps=50",
                               "--config.checkpoint.adaptive_max_steps=10"],
    # every float setting is finite and in range (lr=nan used to pass and its NaN update was applied)
    "lr nan": ["--config.optim.lr=nan"],
    "lr inf": ["--config.optim.lr=inf"],
    "lr negative": ["--config.optim.lr=-1e-3"],
    "b2 above 1": ["--config.optim.b2=1.5"],
    "eps zero": ["--config.optim.eps=0"],
    "weight decay nan": ["--config.optim.weight_decay=nan"],
    "norm eps inf": ["--config.model.norm_eps=inf"],
    "capacity factor nan": ["--config.model.n_experts=4", "--config.model.capacity_factor=nan"],
    "eval fraction above 1": ["--config.data.eval_fraction=2.0"],
    "sample temperature negative": ["--config.sample.temperature=-1"],
    "checkpoint seconds nan": ["--config.checkpoint.every_seconds=nan"],
    "unknown on_divergence": ["--config.optim.on_divergence=ignore"],
    "no skips allowed": ["--config.optim.max_consecutive_skips=0"],
    "no failed save allowed": ["--config.checkpoint.max_failed_saves=0"],
    # communication-efficient training
    "unknown comm format": ["--config.mesh.replica=4", "--config.comm.format=int3"],
    "unknown error feedback": ["--config.mesh.replica=4", "--config.comm.error_feedback=ef3"],
    "comm block odd": ["--config.mesh.replica=4", "--config.comm.format=int4", "--config.comm.block=255"],
    "comm block zero": ["--config.mesh.replica=4", "--config.comm.format=int8", "--config.comm.block=0"],
    "compression over a replica axis of one": ["--config.comm.format=int8"],
    "diloco over a replica axis of one": ["--config.diloco.inner_steps=10"],
    "diloco H negative": ["--config.mesh.replica=4", "--config.diloco.inner_steps=-1"],
    "diloco fragments above layers": ["--config.mesh.replica=4", "--config.diloco.inner_steps=12",
                                      "--config.diloco.fragments=3"],
    "diloco fragments not dividing H": ["--config.mesh.replica=4", "--config.diloco.inner_steps=5",
                                        "--config.diloco.fragments=2"],
    "diloco delay not below H": ["--config.mesh.replica=4", "--config.diloco.inner_steps=10",
                                 "--config.diloco.delay=10"],
    "diloco format unknown": ["--config.mesh.replica=4", "--config.diloco.inner_steps=10",
                              "--config.diloco.format=int2"],
    "diloco with a compressed gradient": ["--config.mesh.replica=4", "--config.diloco.inner_steps=10",
                                          "--config.comm.format=int8"],
    "diloco drop probability above 1": ["--config.mesh.replica=4", "--config.diloco.inner_steps=10",
                                        "--config.diloco.drop_prob=1.5"],
    "comm axis unknown": ["--config.mesh.replica=4", "--config.comm.axis=fsdp"],
    "compression with experts inside a replica": ["--config.mesh.replica=4", "--config.comm.format=int8",
                                                  "--config.model.n_experts=4"],
    # rope scaling
    "unknown rope scaling": ["--config.model.rope_scaling=ntk"],
    "rope factor zero": ["--config.model.rope_scaling=linear", "--config.model.rope_factor=0.0"],
    "rope factor nan": ["--config.model.rope_scaling=yarn", "--config.model.rope_original_max_len=64",
                        "--config.model.rope_factor=nan"],
    "llama3 rope without the original length": ["--config.model.rope_scaling=llama3", "--config.model.rope_factor=8.0"],
    "llama3 rope low frequency factor not below high": [
        "--config.model.rope_scaling=llama3", "--config.model.rope_factor=8.0",
        "--config.model.rope_original_max_len=64", "--config.model.rope_low_freq_factor=4.0"],
    "yarn rope beta slow above fast": ["--config.model.rope_scaling=yarn", "--config.model.rope_factor=4.0",
                                       "--config.model.rope_original_max_len=64", "--config.model.rope_beta_slow=64.0"],
    "yarn rope attention factor negative": ["--config.model.rope_scaling=yarn", "--config.model.rope_factor=4.0",
                                            "--config.model.rope_original_max_len=64",
                                            "--config.model.rope_attention_factor=-1.0"],
    # context parallelism
    "seq_len not in 2 x context chunks": ["--config.mesh.context=8", "--config.train.seq_len=120"],
    "context with experts": ["--config.mesh.context=2", "--config.model.n_experts=4"],
    "context with an explicit reduction": ["--config.mesh.context=2", "--config.mesh.replica=2",
                                           "--config.comm.format=int8"],
    "context does not divide devices": ["--config.mesh.context=3"],
    # host offload: a choice, activations only under remat, none of it on CPU (memory kinds)
    "offload unknown": ["--config.train.offload=grads"],
    "offload activations without remat": ["--config.train.offload=activations"],
    "offload on CPU": ["--config.train.offload=optimizer"],
    "offload with an explicit reduction": ["--config.mesh.replica=2", "--config.comm.format=int8",
                                           "--config.train.offload=optimizer"],
}


@pytest.mark.parametrize("name", BAD)
def test_bad_config_exits_2_with_one_line(name, capsys, tmp_path):
  code = main(["train", f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path}", *BAD[name]])
  err = capsys.readouterr().err.strip()
  assert code == 2
  assert len(err.splitlines()) == 1 and err.startswith("error: "), err
  assert not os.listdir(tmp_path)  # refused before anything ran


def test_cli_exit_status_in_a_real_process(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py",
                      f"--workdir={tmp_path}", "--config.mesh.rules=nope"], capture_output=True, text=True,
                     env=env)
  assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "mesh.rules" in p.stderr


def test_overrides_are_typed():
  cfg = config_files.apply_overrides(config_lib.default_config(),
                                   {"optim.lr": "1e-3", "train.steps": "7", "model.tie_embeddings": "false"})
  assert cfg.optim.lr == 1e-3 and cfg.train.steps == 7 and cfg.model.tie_embeddings is False


def test_a_run_saved_before_a_key_existed_resumes_when_the_key_has_its_default():
  saved = config_lib.default_config().to_dict()
  del saved["model"]["rope_scaling"]  # a checkpoint written before RoPE scaling existed
  current = config_lib.default_config()
  assert config_lib.incompatible(saved, current.to_dict()) == []
  current.model.rope_scaling = "linear"
  assert config_lib.incompatible(saved, current.to_dict()) == ["model.rope_scaling: 'none' -> 'linear'"]


def test_no_config_section_imports_jax():
  """Every module of the config package (one per section) stays importable without jax."""
  paths = glob.glob(os.path.join(ROOT, "jaxtrain", "config", "*.py"))
  assert len(paths) > 3
  for path in paths:
    assert not re.search(r"^\s*(import|from) jax\b", open(path).read(), re.M), path
