"""Config keys that no config, experiment or other test sets: each set to a value other than its
default, and the behaviour it changes asserted (STYLE rule 6: a key exists only if a test exercises
it)."""

import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import checkpoint, errors, optim
from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.model import layers
from jaxtrain.posttrain import data as post_data
from jaxtrain.posttrain.grpo import Grpo
from jaxtrain.posttrain.reward import RewardModel
from jaxtrain.train import loop
from tests.fixtures import tiny_config
from tests.posttrain.test_grpo import rl_config


def test_checkpoint_fast_every_seconds_saves_the_fast_tier_by_time(tmp_path):
  """The fast tier's first step is due, and the next one only once fast_every_seconds passed."""
  due = {}
  for seconds in (3600.0, 0.05):
    k = tiny_config(checkpoint=dict(fast_dir=str(tmp_path / f"fast{seconds}"),
                                    fast_every_seconds=seconds)).checkpoint
    ckpts = checkpoint.Checkpoints(k, str(tmp_path / f"run{seconds}"))
    # nothing saved yet; the persistent tier saves at the end only
    assert [t.name for t in ckpts.due(1)] == ["fast"]
    ckpts.save(1, {"w": jnp.arange(4.0)}, {}, {})
    ckpts.wait()
    time.sleep(0.2)
    due[seconds] = [t.name for t in ckpts.due(2)]
    ckpts.close()
  assert due == {3600.0: [], 0.05: ["fast"]}


def test_model_rope_high_freq_factor_bounds_the_frequencies_llama3_keeps():
  """llama3: wavelengths below original_max_len / high_freq_factor keep their frequency, those above
  original_max_len / low_freq_factor are divided by the factor, a smooth mix between."""
  base = dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=256, head_dim=64)
  plain_U = np.asarray(layers.FREQUENCIES["none"](ModelConfig(**base), 64))
  wavelen_U = 2 * np.pi / plain_U
  kept = {}
  for high in (4.0, 16.0):
    got_U = layers.FREQUENCIES["llama3"](ModelConfig(**base, rope_high_freq_factor=high), 64)
    keep_U = wavelen_U < 256 / high
    np.testing.assert_allclose(got_U[keep_U], plain_U[keep_U], rtol=1e-6)
    np.testing.assert_allclose(got_U[wavelen_U > 256], plain_U[wavelen_U > 256] / 8, rtol=1e-6)
    mid_U = ~keep_U & (wavelen_U <= 256)
    assert np.all(got_U[mid_U] < plain_U[mid_U]) and np.all(got_U[mid_U] > plain_U[mid_U] / 8)
    kept[high] = int(keep_U.sum())
  assert kept[16.0] < kept[4.0]  # a larger factor keeps fewer frequencies


def _updates(o, grads):
  """The parameter updates of the optimizer `o` (an `optim` section) over a list of gradients."""
  tx, _ = optim.build(o, steps=10)
  params = {"w": jnp.zeros(4)}
  state, out = tx.init(params), []
  for g in grads:
    u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    out.append(np.asarray(u["w"]))
  return out


def test_optim_grad_clip_clips_the_global_norm_before_the_optimizer():
  grads = [np.array([30.0, -40.0, 0.0, 0.0]), np.array([1.0, 1.0, -1.0, 1.0])]  # norms 50 and 2
  clipped = [g * min(1.0, 2.0 / np.linalg.norm(g)) for g in grads]
  o = tiny_config(optim=dict(grad_clip=2.0, warmup_steps=0, weight_decay=0.0)).optim
  off = tiny_config(optim=dict(grad_clip=0.0, warmup_steps=0, weight_decay=0.0)).optim
  got, want, unclipped = _updates(o, grads), _updates(off, clipped), _updates(off, grads)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # clipping step 1 changed step 2's moments: unclipped, step 1's gradient outweighs step 2's
  assert np.abs(got[1] - unclipped[1]).max() > 0.1 * np.abs(unclipped[1]).max()


def test_optim_skip_nonfinite_off_lets_a_nan_update_through():
  grads = [np.ones(4), np.array([np.nan, 1.0, 1.0, 1.0])]
  on = _updates(tiny_config().optim, grads)
  off = _updates(tiny_config(optim=dict(skip_nonfinite=False)).optim, grads)
  assert np.all(on[1] == 0) and np.isfinite(on[0]).all()  # skipped: the parameters stay
  assert np.isnan(off[1]).any()


class _Ckpts:
  """Checkpoints with a good step 4, whose restore is never reached here (it raises Restored)."""

  def wait(self):
    pass

  def latest_good(self):
    return 4

  def delete_after(self, step):
    raise _Restored(step)


class _Restored(Exception):
  pass


def test_optim_max_rollbacks_is_how_many_rollbacks_a_run_takes_before_it_stops():
  cfg = tiny_config(optim=dict(on_divergence="rollback", max_rollbacks=1))
  with pytest.raises(_Restored):  # the first divergence rolls back to step 4
    loop._rollback(cfg, _Ckpts(), None, 7, rollbacks=0)
  with pytest.raises(errors.Diverged, match=r"1 rollbacks already \(optim.max_rollbacks=1\)"):
    loop._rollback(cfg, _Ckpts(), None, 7, rollbacks=1)
  cfg.optim.max_rollbacks = 0
  with pytest.raises(errors.Diverged, match=r"0 rollbacks already \(optim.max_rollbacks=0\)"):
    loop._rollback(cfg, _Ckpts(), None, 7, rollbacks=0)


def test_posttrain_advantage_scale_none_only_centres_the_group(tmp_path):
  reward_N = jnp.array([1.0, 3.0, 0.0, 0.5, 2.0, 2.0, 4.0, 0.0])  # groups of 2
  centred = np.array([-1.0, 1.0, -0.25, 0.25, 0.0, 0.0, 2.0, -2.0])
  got = {}
  for scale in ("std", "none"):
    task = Grpo(rl_config(advantage_scale=scale), str(tmp_path / scale))
    got[scale] = np.asarray(task.advantages(None, {}, reward_N)["advantages"])
  np.testing.assert_allclose(got["none"], centred, rtol=1e-6)
  np.testing.assert_allclose(got["std"], np.sign(centred), rtol=1e-5)  # std of a pair: |half gap|


def _text_cfg(**posttrain):
  return tiny_config(model=dict(vocab_size=258, max_seq_len=64), train=dict(seq_len=64),
                     data=dict(kind="text", tokenizer="byte"), posttrain=posttrain)


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _examples(cfg, workdir, pairs):
  return [np.concatenate([np.ravel(a) for a in jax.tree.leaves(e)])
          for e in post_data.Data(cfg, str(workdir), pairs).examples["train"]]


@pytest.mark.parametrize("pairs, renamed", [
    (False, {"completion_field": "answer"}),
    (False, {"messages_field": "conversation"}),
    (True, {"chosen_field": "good", "rejected_field": "bad"})])
def test_posttrain_field_names_pick_the_jsonl_fields(tmp_path, pairs, renamed):
  """Rows whose fields carry the configured names encode as the default-named rows do; under the
  default names they are all skipped."""
  chat = lambda i: [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
  default_names = {"completion_field": "completion", "messages_field": "messages",
                   "chosen_field": "chosen", "rejected_field": "rejected"}
  rows = []
  for i in range(20):
    if pairs:
      rows.append({"prompt": f"p{i}", "chosen": f"yes {i}", "rejected": f"no {i}"})
    elif "messages_field" in renamed:
      rows.append({"messages": chat(i)})
    else:
      rows.append({"prompt": f"p{i}", "completion": f"c{i}"})
  moved = [{renamed.get(f"{k}_field", k) if f"{k}_field" in default_names else k: v
            for k, v in r.items()} for r in rows]
  for k in renamed:
    assert all(default_names[k] not in r for r in moved)
  plain = _text_cfg(train_path=_write(tmp_path / "plain.jsonl", rows), eval_fraction=0.2)
  want = _examples(plain, tmp_path / "a", pairs)
  moved_path = _write(tmp_path / "moved.jsonl", moved)
  got = _examples(_text_cfg(train_path=moved_path, eval_fraction=0.2, **renamed), tmp_path / "b",
                  pairs)
  assert len(got) == len(want) > 0 and all(np.array_equal(a, b) for a, b in zip(got, want))
  with pytest.raises(ConfigError, match="no usable training rows"):
    post_data.Data(_text_cfg(train_path=moved_path, eval_fraction=0.2), str(tmp_path / "c"), pairs)


def test_posttrain_rm_center_adds_the_mean_squared_score(tmp_path):
  cfg = tiny_config(model=dict(n_layers=1, scan_layers=False), data=dict(symbols=40),
                    train=dict(task="rm", seq_len=16, batch_size=8),
                    posttrain=dict(synthetic_examples=40))
  task = RewardModel(cfg, str(tmp_path))
  params = nn.unbox(task.init(jax.random.key(0))[0])
  batch = jax.tree.map(jnp.asarray, next(task.batches("train", 0, 8)))
  # the config is read when the loss is traced: a new function each time, so that it is traced again
  loss0, _ = jax.jit(lambda *a: task.loss(*a))(params, batch, {}, {})
  cfg.posttrain.rm_center = 0.5
  loss1, sums = jax.jit(lambda *a: task.loss(*a))(params, batch, {}, {})
  score_BT = np.asarray(jax.jit(task._pair_scores)(params, batch))
  center = 0.5 * np.sum(np.mean(np.square(score_BT), -1) * np.asarray(batch["valid"]))
  assert center > 0 and float(sums["loss"]) == pytest.approx(float(loss0), rel=1e-6)
  assert float(loss1) - float(loss0) == pytest.approx(center, rel=1e-4)
