"""A run whose updates are all non-finite stops with one line (errors.Diverged, exit status 4) after
optim.max_consecutive_skips, or rolls back to the last good checkpoint and skips the offending batches
(optim.on_divergence=rollback, PaLM's recipe); every opened sink is closed either way."""

import numpy as np
import pytest

import jaxtrain
from jaxtrain import errors, metrics
from jaxtrain.core.lm import LanguageModel
from tests.fixtures import tiny_config


class PoisonedBatches:
  """The language-model batches, with NaN loss masks for the global batch indices in `bad`."""

  def __init__(self, inner, bad):
    self.inner, self.bad = inner, bad

  def __iter__(self):
    return self

  def __next__(self):
    index = self.inner.get_state()["index"]
    batch = next(self.inner)
    if index in self.bad:
      batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
    return batch

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


class Poisoned(LanguageModel):

  def __init__(self, cfg, workdir, bad):
    super().__init__(cfg, workdir)
    self.bad = bad

  def batches(self, split, lo, hi):
    inner = super().batches(split, lo, hi)
    return PoisonedBatches(inner, self.bad) if split == "train" else inner


def test_all_nonfinite_updates_stop_the_run_with_one_line(tmp_path):
  cfg = tiny_config(train=dict(steps=40), optim=dict(lr=1e30, max_consecutive_skips=5))
  with pytest.raises(errors.Diverged) as e:
    jaxtrain.train(cfg, str(tmp_path), progress=False, sync_every_step=True)
  message = str(e.value)
  assert "\n" not in message and "optim.max_consecutive_skips" in message and "on_divergence" in message
  assert e.value.exit_status == 4
  rows = [r for r in metrics.read_metrics(str(tmp_path)) if "loss" in r]
  assert rows[-1]["step"] < 12 and rows[-1]["consecutive_skips"] >= 5  # stopped early, not after 40 steps


@pytest.mark.slow  # ~33 s on 2 cores: the default suite stays under 10 minutes
def test_rollback_restores_the_last_good_checkpoint_and_skips_the_bad_batches(tmp_path):
  cfg = tiny_config(train=dict(steps=16), checkpoint=dict(every_steps=4, keep=5),
                    optim=dict(max_consecutive_skips=3, on_divergence="rollback"))
  workdir = str(tmp_path)
  final = jaxtrain.train(cfg, workdir, task=Poisoned(cfg, workdir, bad=range(8, 14)), progress=False,
                         sync_every_step=True)
  rows = metrics.read_metrics(workdir)
  rollbacks = [r for r in rows if r.get("event") == "rollback"]
  # batches 8, 9, 10 fail (steps 9-11): back to the checkpoint of step 8; steps 9, 10 then meet batches
  # 12, 13 (skipped, 2 < 3 in a row) and step 11 batch 14, which is good
  assert [(r["step"], r["from_step"]) for r in rollbacks] == [(8, 11)]
  assert final["step"] == 16 and final["rollbacks"] == 1 and np.isfinite(final["loss"])
  losses = {r["step"]: r for r in rows if "loss" in r}
  assert losses[16]["skipped_steps"] == 2 and losses[16]["consecutive_skips"] == 0


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_rollback_without_a_checkpoint_stops(tmp_path):
  cfg = tiny_config(train=dict(steps=12), optim=dict(max_consecutive_skips=2, on_divergence="rollback"))
  with pytest.raises(errors.Diverged, match="no checkpoint to roll back to"):
    jaxtrain.train(cfg, str(tmp_path), task=Poisoned(cfg, str(tmp_path), bad=range(2, 12)), progress=False,
                   sync_every_step=True)


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_cli_diverged_run_exits_4_with_one_line(tmp_path, capsys):
  from jaxtrain.__main__ import main
  from tests.fixtures import ROOT
  code = main(["train", f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path}", "--no_sample",
               "--config.optim.lr=1e30", "--config.optim.max_consecutive_skips=3", "--config.train.steps=30",
               "--config.optim.warmup_steps=1",
               "--config.train.batch_size=8", "--config.model.d_model=32", "--config.model.d_ff=64",
               "--config.model.head_dim=8", "--config.train.seq_len=32"])
  err = capsys.readouterr().err.strip().splitlines()  # the progress bar's lines, then one error line
  assert code == 4 and err[-1].startswith("error: training diverged") and sum("error" in e for e in err) == 1, err


def test_nan_steps_poison_those_batches_and_the_updates_are_skipped(tmp_path):
  """train.nan_steps (tools/soak.py's injected fault): steps 3 and 5 meet NaN batches, their
  updates are skipped, and the run goes on; a bad list is one line."""
  cfg = tiny_config(train=dict(steps=6, log_every=1, nan_steps="3,5"))
  jaxtrain.train(cfg, str(tmp_path), progress=False, sync_every_step=True)
  rows = {r["step"]: r for r in metrics.read_metrics(str(tmp_path)) if "loss" in r}
  assert [rows[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
  assert np.isfinite(rows[6]["loss"])
  from jaxtrain.config import ConfigError, validate
  for bad in ("0", "3,x"):
    with pytest.raises(ConfigError, match="train.nan_steps must be comma-separated steps"):
      validate(tiny_config(train=dict(nan_steps=bad)), 8)
