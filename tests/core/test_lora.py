"""LoRA fine-tuning (core/lora.py): only adapters are trained, in the optimizer state and in
checkpoints; the frozen base is an argument of the step, read again from checkpoint.init_from at
every restore, and never changes; resume is bitwise; load_params gives the merged weights; DPO and
GRPO run with the base as their reference; bad configs are one line."""

import os
import shutil

import flax.linen as nn
import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import builder, checkpoint, metrics, parallel
from jaxtrain.checkpoint import convert, hf, pretrained
from jaxtrain.config import ConfigError, validate
from jaxtrain.core import lora as lora_task, state as state_lib
from jaxtrain.model import lora
from jaxtrain.plan import compiled
from jaxtrain.posttrain import Sft
from tests.fixtures import tiny_config
from tests.posttrain.test_dpo import dpo_config
from tests.posttrain.test_grpo import rl_config
from tests.posttrain.test_sft import sft_config

TARGETS = ".*"  # every weight of a known kind: the embedding too (the tiny base barely knows it)


def lora_config(cfg, base: str, rank: int = 4):
  cfg.model.update(lora_rank=rank, lora_alpha=8.0, lora_targets=TARGETS)
  cfg.checkpoint.init_from = base
  return cfg


def train(cfg, workdir):
  jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  return [r for r in metrics.read_metrics(workdir) if "loss" in r]


def save_bytes(workdir) -> int:
  return [r for r in metrics.read_metrics(workdir) if r.get("event") == "checkpoint_save"][-1][
      "save_bytes"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A short full SFT run: the base of the LoRA runs (and what a full fine-tune checkpoints)."""
  workdir = str(tmp_path_factory.mktemp("lora") / "base")
  train(sft_config(steps=3), workdir)
  return workdir


def restored(cfg, workdir):
  mesh, task, tx, _ = builder.build(cfg, workdir)
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, workdir, read_only=True)
  state = builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  return state


def test_lora_rank_zero_is_the_task_and_bad_configs_are_one_line(tmp_path):
  assert type(builder.make_task(sft_config(), str(tmp_path))) is Sft
  cases = ((dict(lora_rank=-1), "", "model.lora_rank must be >= 0"),
           (dict(lora_rank=4), "", "set checkpoint.init_from"),
           (dict(lora_rank=4, lora_alpha=0.0), "runs/x", "model.lora_alpha must be positive"),
           (dict(lora_rank=4, lora_targets="(q"), "runs/x", "is not a regex"),
           (dict(lora_rank=4, lora_base_bits=4), "runs/x", "must be 0 .* or 8"),
           (dict(lora_base_bits=8), "", "set model.lora_rank > 0"))
  for model, init_from, match in cases:
    cfg = sft_config()
    cfg.model.update(model)
    cfg.checkpoint.init_from = init_from
    with pytest.raises(ConfigError, match=match) as e:
      validate(cfg, 8)
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="LoRA runs lm, sft, dpo, grpo, ppo"):
    validate(lora_config(tiny_config(train=dict(task="rm")), "runs/x"), 8)
  cfg = lora_config(sft_config(), "runs/x")
  cfg.model.lora_targets = r".*attn/query"
  with pytest.raises(ConfigError, match="matches no weight of the model"):
    builder.make_task(cfg, str(tmp_path))


@pytest.mark.slow  # three short runs
def test_lora_sft_trains_adapters_only_and_resumes_bitwise(base, tmp_path):
  cfg = lora_config(sft_config(steps=10), base)
  cfg.checkpoint.every_steps = 5
  cfg.optim.lr = 3e-2
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  rows = train(cfg, straight)
  assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, [r["loss"] for r in rows]
  # the trained params and the optimizer's moments are the adapters: no leaf of the model's shape
  state = restored(cfg, straight)
  paths = {lora.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]}
  assert paths and all(p.endswith(("/a", "/b")) for p in paths)
  adapter_shapes = {x.shape for x in jax.tree.leaves(state.params)}
  assert {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim} <= adapter_shapes
  # the base (refilled from init_from at restore) is the base run's params, bitwise
  _, base_params = pretrained.load_params(base)
  frozen = state.task_state[lora_task.BASE].tree
  assert all(np.array_equal(x, y)
             for x, y in zip(jax.tree.leaves(base_params), jax.tree.leaves(frozen)))
  # checkpoints hold the adapters only (their moments too): under a quarter of the full fine-tune's
  # bytes at rank 4 on this 32-wide model
  tree = pretrained.state_metadata(*pretrained.find_step(straight))
  assert [tuple(x.shape) for x in jax.tree.leaves(tree["task_state"])] == [()]  # the base's step alone
  assert int(state.task_state[lora_task.BASE_STEP]) == pretrained.find_step(base)[1]
  assert save_bytes(straight) < save_bytes(base) / 4, (save_bytes(straight), save_bytes(base))
  # load_params (sample, eval, export, a later init_from): base + alpha / r * A @ B
  model_cfg, merged = pretrained.load_params(straight)
  assert model_cfg.lora_rank == 0
  ad = jax.tree.map(np.asarray, state.params)["layers"]["attn"]["q"]
  want = base_params["layers"]["attn"]["q"] + 2.0 * np.einsum("zdr,zrhk->zdhk", ad["a"], ad["b"])
  np.testing.assert_allclose(merged["layers"]["attn"]["q"], want, rtol=1e-5, atol=1e-6)
  assert not np.array_equal(merged["layers"]["attn"]["q"], base_params["layers"]["attn"]["q"])
  assert np.array_equal(merged["final_norm"]["scale"], base_params["final_norm"]["scale"])
  # HF export writes the merged model
  _, exported = hf.import_hf(convert.to_hf(straight, str(tmp_path / "hf")))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(merged),
                                                  jax.tree.leaves(exported)))
  # a run stopped after step 5, rerun: the same losses and adapters, bitwise
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "10"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  again = train(cfg, resumed)
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[5:]]
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state.params),
                                                  jax.tree.leaves(restored(cfg, resumed).params)))


@pytest.mark.slow  # a LoRA run, its base trained on, the LoRA run resumed
def test_a_resumed_lora_run_keeps_the_base_step_it_started_from(base, tmp_path):
  """The base run trains on after the LoRA run started: the resumed LoRA run, and load_params of
  it, still read the base at the step the run started from."""
  moving = str(tmp_path / "base")
  shutil.copytree(base, moving)
  started = pretrained.find_step(moving)[1]
  cfg = lora_config(sft_config(steps=4), moving)
  cfg.checkpoint.every_steps = 2
  cfg.optim.lr = 3e-2
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  rows = train(cfg, straight)
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  train(sft_config(steps=started + 2), moving)  # the base trains on: a newer step
  assert pretrained.find_step(moving)[1] == started + 2
  again = train(cfg, resumed)
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[2:]]
  state = restored(cfg, resumed)
  _, at_start = pretrained.load_params(moving, started)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(at_start),
                                                  jax.tree.leaves(state.task_state[lora_task.BASE].tree)))
  _, merged = pretrained.load_params(resumed)
  want = lora.merge(at_start, jax.tree.map(np.asarray, state.params), 8.0, 4)
  assert all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(merged)))


@pytest.mark.slow  # compiles a step
def test_the_step_changes_the_adapters_and_never_the_base(base, tmp_path):
  cfg = lora_config(sft_config(), base)
  run = builder.build(cfg, str(tmp_path))
  state, shardings = state_lib.create_state(run.task, run.tx, 0, run.mesh, cfg.mesh.rules)
  load = lambda like, step=None: builder.init_params(base, like, step)
  params, task_state = run.task.init_from(state.params, state.task_state, load)
  state = state.replace(params=params, task_state=task_state)
  before = jax.tree.map(np.asarray, (state.params, state.task_state))
  feed = parallel.Feed(run.task.batch_size, parallel.batch_sharding(run.mesh))
  batches = run.task.batches("train", feed.lo, feed.hi)
  with parallel.activate(run.mesh, cfg.mesh.rules):
    train_fn, _ = builder.compile_steps(cfg, *run, shardings)
    for _ in range(2):
      state, _ = train_fn(state, feed.put(next(batches)))
  after = jax.tree.map(np.asarray, (state.params, state.task_state))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[1]),
                                                  jax.tree.leaves(after[1])))
  assert not any(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[0]),
                                                      jax.tree.leaves(after[0])))


@pytest.mark.slow  # two short runs
def test_lora_dpo_starts_at_the_reference(base, tmp_path):
  """The base is DPO's reference and B = 0: the first step's policy is the reference (loss log 2,
  KL 0); then the adapters move."""
  rows = train(lora_config(dpo_config(), base), str(tmp_path / "dpo"))
  assert abs(rows[0]["loss"] - np.log(2)) < 1e-6 and abs(rows[0]["kl"]) < 1e-6
  assert len(rows) == 4 and rows[-1]["kl"] > 0


@pytest.mark.slow  # two short runs with rollouts
@pytest.mark.long  # 78 s in CI's compute phase (2-core EPYC, 2026-12-07): an RL run's quick budget
def test_lora_grpo_runs_with_the_base_as_reference(tmp_path):
  base_dir, run_dir = str(tmp_path / "base"), str(tmp_path / "grpo")
  train(rl_config(steps=1), base_dir)
  cfg = lora_config(rl_config(), base_dir)
  cfg.model.lora_targets = r".*attn/(q|v)"
  rows = train(cfg, run_dir)
  assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
  assert abs(rows[0]["kl"]) < 1e-6  # the policy starts as its reference, the base
  assert "reference" not in restored(cfg, run_dir).task_state  # no second copy of the base
  assert save_bytes(run_dir) < save_bytes(base_dir) / 10


@pytest.mark.optimized
@pytest.mark.slow  # compiles two steps
def test_compiled_step_memory_with_lora_is_below_full_fine_tuning(tmp_path, monkeypatch):
  """The optimizer's moments and the gradient are adapter-sized: the step's argument bytes are the
  base once plus small change, against params and two moments of full fine-tuning."""
  monkeypatch.chdir(tmp_path)  # the abstract step's task writes its synthetic data into "."
  full = compiled.compiled_memory(sft_config(), quick=True)
  small = compiled.compiled_memory(lora_config(sft_config(), "runs/base"), quick=True)
  assert small["argument"] < 0.6 * full["argument"], (small, full)
  assert small["total"] < full["total"], (small, full)


@pytest.mark.slow  # two short runs with rollouts
@pytest.mark.long  # 79 s in CI's compute phase (2-core EPYC, 2026-12-07): an RL run's quick budget
def test_lora_ppo_trains_adapters_and_its_fresh_value_head(tmp_path):
  """The value head is not in the base (init_from keeps it fresh): it is trained in full beside
  the adapters, and checkpointed with them."""
  base_dir, run_dir = str(tmp_path / "base"), str(tmp_path / "ppo")
  train(rl_config("ppo", steps=1), base_dir)
  cfg = lora_config(rl_config("ppo"), base_dir)
  rows = train(cfg, run_dir)
  assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
  state = restored(cfg, run_dir)
  paths = [lora.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
  adapters = [p for p in paths if not p.startswith("value_head/")]
  assert len(paths) - len(adapters) == 2 and all(p.endswith(("/a", "/b")) for p in adapters)
  assert np.asarray(state.params["value_head"]["w"]).any()  # trained from its zero init
  assert "value_head" not in state.task_state[lora_task.BASE].tree


@pytest.mark.slow  # three short runs
def test_an_int8_base_trains_resumes_bitwise_and_merges_as_the_run_saw_it(base, tmp_path):
  """model.lora_base_bits=8: the state's base holds the layer weights in int8 (refilled and
  requantized at restore: resume stays bitwise), the first loss is the float base's to rounding,
  and load_params merges the adapters into the base the run trained against."""
  cfg = lora_config(sft_config(steps=6), base)
  cfg.model.lora_base_bits = 8
  cfg.checkpoint.every_steps = 3
  cfg.optim.lr = 3e-2
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  rows = train(cfg, straight)
  assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, [r["loss"] for r in rows]
  float_first = train(lora_config(sft_config(steps=1), base), str(tmp_path / "float"))[0]["loss"]
  assert rows[0]["loss"] != float_first and abs(rows[0]["loss"] - float_first) < 0.01 * float_first
  state = restored(cfg, straight)
  frozen = state.task_state[lora_task.BASE].tree
  _, base_params = pretrained.load_params(base)
  for kind in ("q", "k", "v", "o"):
    node, w = frozen["layers"]["attn"][kind], base_params["layers"]["attn"][kind]
    assert isinstance(node, lora.Int8) and node.q.dtype == np.int8 and node.q.nbytes == w.size
  assert np.array_equal(frozen["embed"], base_params["embed"])  # kept as it is
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  again = train(cfg, resumed)
  assert [r["loss"] for r in again] == [r["loss"] for r in rows[3:]]
  _, merged = pretrained.load_params(straight)
  want = lora.merge(lora.dequantize(lora.quantize(base_params)),
                    jax.tree.map(np.asarray, state.params), 8.0, 4)
  assert all(np.allclose(np.asarray(x), y, rtol=1e-6, atol=1e-7)
             for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(merged)))
  assert not np.allclose(merged["layers"]["attn"]["q"],
                         lora.merge(base_params, jax.tree.map(np.asarray, state.params), 8.0,
                                    4)["layers"]["attn"]["q"], rtol=0, atol=1e-7)
