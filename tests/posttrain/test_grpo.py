"""GRPO as a task on the loop: its loss equals the GRPO formula on independently computed log-probs; the
batch the make_batch seam builds (rollouts, rewards, group advantages, reference log-probs) agrees with the
policy it came from; runs through jaxtrain.train with custom and faulty reward functions; the config file
runs as the CLI runs it; resume mid-run is bitwise (slow)."""

import os
import shutil

import flax.linen as nn
import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import config as config_lib, config_files, metrics, parallel
from jaxtrain.data.tokenizers import Bytes
from jaxtrain.builder import TASKS
from jaxtrain.posttrain import Grpo
from jaxtrain.posttrain.prompts import PromptBatches, Prompts
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from jaxtrain.core.task import Task

from tests.fixtures import ROOT, tiny_config
from tests.posttrain.test_dpo import restore

RL_KEYS = {"loss", "reward_mean", "reward_std", "kl", "entropy", "clip_fraction", "response_length", "accuracy",
           "reward_faults_raised", "reward_faults_non_finite", "reward_faults_wrong_length"}


def rl_config(task="grpo", **posttrain):
  """A very small byte-level decoder on the addition prompts (BOS + "12+345=" fits 10 prompt slots)."""
  return tiny_config(model=dict(vocab_size=258, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                d_ff=64, max_seq_len=16, scan_layers=False),
                     data=dict(kind="text", tokenizer="byte"),
                     train=dict(task=task, steps=3, batch_size=8, seq_len=14, log_every=1, eval_every=0),
                     posttrain=dict(synthetic_examples=40, group_size=2 if task == "grpo" else 1, max_new_tokens=4,
                                    **posttrain))


def response_logp_np(model, params, batch, width, temperature):
  """log softmax(logits / T) at the response tokens, float64, from one forward of the whole rows."""
  logits = np.asarray(jax.jit(model.apply)({"params": params}, batch["tokens"][:, :-1], batch["positions"][:, :-1],
                                           batch["segment_ids"][:, :-1]), np.float64)[:, width - 1:] / temperature
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  return np.take_along_axis(logp, batch["tokens"][:, width:, None], axis=-1)[..., 0], logp


def fixed_batch(rng, n, width, new, vocab=256):
  """Rows of full-width prompts (no padding) and responses, a mask that stops some rows early."""
  tokens = rng.integers(0, vocab, size=(n, width + new)).astype(np.int32)
  mask = (np.arange(new)[None] < rng.integers(1, new + 1, size=(n, 1))).astype(np.float32)
  return {"tokens": tokens, "positions": np.broadcast_to(np.arange(width + new), tokens.shape).astype(np.int32),
          "segment_ids": np.ones_like(tokens), "mask": mask}


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_grpo_loss_equals_the_formula(tmp_path):
  cfg = rl_config(temperature=0.7, clip_eps=0.2, kl_coef=0.3)
  task = Grpo(cfg, str(tmp_path))
  params = nn.unbox(jax.jit(task.init)(jax.random.key(0))[0])
  width, new, n = task.width, cfg.posttrain.max_new_tokens, 8
  rng = np.random.default_rng(0)
  batch = fixed_batch(rng, n, width, new)
  logp, logp_v = response_logp_np(task.model, params, batch, width, 0.7)
  mask = batch["mask"]
  batch.update(logp_old=((logp + rng.normal(0, 0.3, logp.shape)) * mask).astype(np.float32),
               logp_ref=((logp + rng.normal(0, 0.3, logp.shape)) * mask).astype(np.float32),
               advantages=rng.normal(size=n).astype(np.float32), reward=rng.normal(size=n).astype(np.float32),
               faults_raised=np.zeros(n, np.float32))
  for how in ("token", "sequence"):
    cfg.posttrain.aggregate = how
    value, sums = jax.jit(task.loss)(params, batch, {}, {})
    ratio = np.exp(logp - batch["logp_old"])
    a = batch["advantages"][:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
    r = batch["logp_ref"] - logp
    per_token = per_token + 0.3 * (np.exp(r) - r - 1)  # k3
    entropy = -(np.exp(logp_v) * logp_v).sum(-1)
    if how == "token":
      want, count, ent = (per_token * mask).sum(), mask.sum(), (entropy * mask).sum()
    else:
      want = ((per_token * mask).sum(1) / mask.sum(1)).sum()
      count, ent = n, ((entropy * mask).sum(1) / mask.sum(1)).sum()
    np.testing.assert_allclose(float(value), want, rtol=2e-5)
    assert float(sums["count"]) == count
    np.testing.assert_allclose(float(sums["entropy"]), ent, rtol=2e-5)
    got = task.metrics(sums, 1)
    np.testing.assert_allclose(float(got["reward_mean"]), batch["reward"].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(got["reward_std"]), batch["reward"].std(), rtol=1e-4)
    np.testing.assert_allclose(float(got["response_length"]), mask.sum() / n, rtol=1e-6)
  # the gradient is the formula's too: a finite-difference check along one direction would be slow; the
  # loss's own gradient is that of rl.grpo_loss (tests/posttrain/test_rl.py)


def test_make_batch_default_leaves_the_fed_batch():
  batch = {"tokens": np.zeros((2, 3), np.int32)}
  assert Task().make_batch({}, {}, {}, batch, 7) is batch


def batch_maker(cfg, workdir, task, tweak=None):
  """`make(step) -> (batch, the policy's log-probs of its response tokens)` (host numpy), as the loop builds
  a step's batch from the fresh state (`tweak(state) -> state` changes it first); `make.state`."""
  mesh, task, tx, _ = builder.build(cfg, workdir, task=task)
  state, _ = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
  state = state if tweak is None else tweak(state)
  feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
  task.prepare(False)
  logps = jax.jit(lambda p, b: task.token_logps(task.response_logits(task.decoder(p), b), b))

  def make(step):
    with parallel.activate(mesh, cfg.mesh.rules):
      batch = task.make_batch(state.params, state.extra, state.task_state,
                              feed.put(next(task.batches("train", feed.lo, feed.hi))), step)
      logp = logps(state.params, batch)
    return {k: np.asarray(v) for k, v in batch.items()}, np.asarray(logp)

  make.state = state
  return make


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_make_batch_rollouts_rewards_and_group_advantages(tmp_path):
  seen = []

  def digits(prompts, completions, answer, **_):  # a custom reward: the answer's length, and a record
    seen.append((list(prompts), list(completions), list(answer)))
    return [float(len(c)) for c in completions]

  def broken(prompts, completions, **_):
    raise RuntimeError("a bug in a reward function")

  def nan_on_first(prompts, completions, **_):
    return [float("nan")] + [0.0] * (len(completions) - 1)

  cfg = rl_config(temperature=1.0, kl_coef=0.1)
  cfg.mesh.update(data=2, fsdp=4)
  make = batch_maker(cfg, str(tmp_path), Grpo(cfg, str(tmp_path), rewards=[(digits, 2.0), broken, nan_on_first]))
  batch, logp = make(0)
  # faulty reward functions are counted (on row 0, summed by the loss) and give 0, never fatal
  assert batch["faults_raised"].sum() == 16 and batch["faults_by_broken"].sum() == 16
  assert batch["faults_non_finite"].sum() == 1 and batch["faults_by_nan_on_first"].sum() == 1
  n = cfg.train.batch_size * 2
  assert batch["tokens"].shape == (n, cfg.train.seq_len) and batch["mask"].shape == (n, 4)
  mask = batch["mask"]
  # the sampler's log-probs are the policy's on the same tokens (the step's ratio starts at 1)
  np.testing.assert_allclose(batch["logp_old"] * mask, logp * mask, atol=2e-5)
  np.testing.assert_allclose(batch["logp_ref"], logp, atol=2e-5)  # the reference starts as the policy
  (prompts, completions, answers), = seen
  assert len(prompts) == n and prompts[0] == prompts[1] and prompts[0].endswith("=")  # groups of 2 samples
  assert answers[0] == str(sum(map(int, prompts[0][:-1].split("+"))))[::-1]
  np.testing.assert_array_equal(batch["reward"], [2.0 * len(c) for c in completions])
  r = batch["reward"].reshape(-1, 2)
  want = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(batch["advantages"], want.reshape(-1), rtol=1e-5, atol=1e-6)
  # the same step (and prompts) draws the same samples; another step others
  np.testing.assert_array_equal(make(0)[0]["tokens"], batch["tokens"])
  assert not np.array_equal(make(1)[0]["tokens"], batch["tokens"])


def test_prompts_skipped_and_counted(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "1+2=", "answer": "3", "id": 1}\n{"prompt": "' + "1" * 9 + '+1="}\nnot json\n'
                  '{"question": "1+1="}\n{"prompt": "12+1=", "answer": "31"}\n')
  prompts = Prompts(str(path), Bytes(), 8, "prompt")
  assert prompts.counts == {"examples": 2, "prompt_too_long": 1, "missing_field": 1, "bad_json": 1, "unencodable": 0}
  assert prompts.texts == ["1+2=", "12+1="] and prompts.field_names == ["answer"]  # fields every row has
  np.testing.assert_array_equal(prompts.ids_RP[0], [0, 0, 0, 256, *b"1+2="])  # BOS + prompt, left-padded
  batches = PromptBatches(prompts, 4, 0, 0, 4)
  first = next(batches)
  state = batches.get_state()
  second = next(batches)
  assert sorted(first["row"][:2]) == [0, 1] and sorted(first["row"][2:]) == [0, 1]  # epochs of 2 rows
  batches.set_state(state)
  np.testing.assert_array_equal(next(batches)["row"], second["row"])


def run_rl_config(name: str, workdir: str, steps: int = 2, rewards=None, **overrides) -> tuple[dict, list]:
  """configs/NAME.py for a few steps on its own generated prompts (as `python -m jaxtrain train` runs it;
  `rewards`: reward functions passed to the task from Python instead)."""
  cfg = config_files.apply_overrides(config_files.load_config_file(os.path.join(ROOT, "configs", f"{name}.py")), {
      "train.steps": str(steps), "train.log_every": "1", "optim.warmup_steps": "1",
      "posttrain.synthetic_examples": "100", **overrides})
  task = None if rewards is None else TASKS[cfg.train.task](cfg, workdir, rewards=rewards)
  final = jaxtrain.train(cfg, workdir, task=task, progress=False, sync_every_step=True)
  return final, [r for r in metrics.read_metrics(workdir) if "loss" in r]


def digit_share(prompts, completions, **_):
  """The share of digits among a response's 8 tokens: learnable from a random init."""
  return [sum(ch.isdigit() for ch in c) / 8 for c in completions]


def broken(prompts, completions, **_):
  raise RuntimeError("a bug in a reward function")


def nan_on_first(prompts, completions, **_):
  return [float("nan")] + [0.0] * (len(completions) - 1)


@pytest.mark.slow  # the tiny config's model compiles for a while; 40 steps
def test_grpo_tiny_config_raises_a_custom_reward_despite_faulty_ones(tmp_path):
  final, rows = run_rl_config("grpo_tiny", str(tmp_path), steps=40, rewards=[digit_share, broken, (nan_on_first, 1.0)],
                              **{"optim.lr": "3e-3", "train.log_every": "5"})
  assert RL_KEYS <= set(final) and rows[0]["kl"] == 0.0  # policy == reference at the first step
  assert all(np.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
  samples = 8 * 4  # prompts x group_size of the config
  assert all(r["reward_faults_raised"] == samples and r["reward_faults_broken"] == samples for r in rows)  # not fatal
  assert all(r["reward_faults_non_finite"] == 1 and r["reward_faults_nan_on_first"] == 1 for r in rows)
  assert os.path.isfile(os.path.join(str(tmp_path), "posttrain_data", "rl.jsonl"))
  reward = [r["reward_mean"] for r in rows]
  assert reward[-1] > reward[0] + 0.3, reward  # 0.05 -> 0.87 measured


@pytest.mark.slow  # trains a reward model first
def test_reward_model_scores_the_rollouts(tmp_path):
  from jaxtrain.posttrain import exact, load_reward_model
  paths = exact.write_dataset(str(tmp_path / "data"), 0, 0, 64, 0, 0.0, 0)
  rm_cfg = rl_config()
  rm_cfg.train.update(task="rm", steps=2)
  rm_cfg.posttrain.train_path = paths["pairs"]
  jaxtrain.train(rm_cfg, str(tmp_path / "rm"), progress=False, sync_every_step=True)
  seen = []

  def record(prompts, completions, **_):
    seen.append((list(prompts), list(completions)))
    return [0.0] * len(prompts)

  cfg = rl_config(reward_model=str(tmp_path / "rm"), reward_model_weight=2.0)
  batch, _ = batch_maker(cfg, str(tmp_path / "grpo"), Grpo(cfg, str(tmp_path / "grpo"), rewards=[record]))(0)
  (prompts, completions), = seen
  rm = load_reward_model(str(tmp_path / "rm"))
  fits = lambda p, c: 2 + len(p.encode()) + len(c.encode()) <= 16  # rm.texts cuts longer ones before their EOS
  scores = [float(rm.texts([p], [c])[0]) if c.strip() and fits(p, c) else None for p, c in zip(prompts, completions)]
  got = [r for r, s in zip(batch["reward"], scores) if s is not None]
  assert len(got) > 4 and batch["faults_raised"].sum() == 0
  np.testing.assert_allclose(got, [2 * s for s in scores if s is not None], rtol=1e-4, atol=1e-5)


def test_rl_config_is_checked():
  for task, key, value in (("grpo", "group_size", 1), ("grpo", "temperature", 0.0), ("ppo", "max_new_tokens", 0),
                           ("grpo", "max_new_tokens", 13), ("ppo", "aggregate", "mean")):
    cfg = rl_config(task)
    cfg.posttrain[key] = value
    with pytest.raises(config_lib.ConfigError):
      config_lib.validate(cfg, 8)
  cfg = rl_config()
  cfg.train.eval_every = 2
  with pytest.raises(config_lib.ConfigError, match="eval_every=0"):
    config_lib.validate(cfg, 8)


@pytest.mark.slow  # three runs
def test_resume_mid_grpo_is_bitwise(tmp_path):
  cfg = rl_config(temperature=1.0, kl_coef=0.1)
  cfg.mesh.update(data=2, fsdp=4)  # rollouts and the step on a sharded mesh
  cfg.train.steps = 4
  cfg.checkpoint.update(every_steps=2)
  cfg.optim.update(lr=3e-3, warmup_steps=1)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  jaxtrain.train(cfg, straight, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(straight) if "loss" in r]
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  os.remove(os.path.join(resumed, "metrics.jsonl"))
  jaxtrain.train(cfg, resumed, progress=False, sync_every_step=True)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["step"] for r in again] == [3, 4]
  def untimed(row):  # every value but the clock's: step time and throughput, and the goodput accounting's seconds
    return {k: v for k, v in row.items()
            if k not in ("step_time_s", "tokens_per_sec", "mfu", "goodput") and not k.startswith(("goodput_", "badput_"))}
  assert [untimed(r) for r in again] == [untimed(r) for r in rows[2:]]
  a, b = jax.device_get(restore(cfg, straight).params), jax.device_get(restore(cfg, resumed).params)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert rows[-1]["reward_std"] > 0 or rows[-1]["entropy"] > 0
