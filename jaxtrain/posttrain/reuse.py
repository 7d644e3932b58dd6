"""Rollout reuse for PPO and GRPO (posttrain.ppo_epochs, posttrain.minibatches): each rollout batch
is trained on for several epochs of shuffled minibatches, one optimizer step per minibatch, as TRL,
OpenRLHF and Tunix do. That reuse is what the clipped ratio is for: after the first minibatch the
params have moved away from those that sampled the tokens.

The loop's step s is minibatch `s % U` of rollout batch `s // U`, with U = ppo_epochs x
minibatches steps a rollout (`Schedule`). The rollout batch is sampled at its first step and kept on
the host; it is also written to WORKDIR/rl_rollouts (`Store`, the newest few), so that a run
resumed mid-epoch trains on the samples the uninterrupted run drew (the params that drew them are
gone). Minibatch rows are a permutation per epoch from (seed, rollout batch, epoch): a function of
the step alone.
"""

import os
from typing import NamedTuple

import numpy as np

from jaxtrain import config as config_lib

ROLLOUTS_DIR = "rl_rollouts"
KEEP = 4  # rollout batches kept on disk (a resume reads the one its checkpoint is inside)


class Schedule(NamedTuple):
  """Which rollout batch, epoch and minibatch a step trains on."""
  epochs: int
  minibatches: int
  samples: int  # rows of a rollout batch
  seed: int

  @property
  def steps_per_rollout(self) -> int:
    return self.epochs * self.minibatches

  @property
  def rows(self) -> int:
    """Rows of a minibatch: the step's batch."""
    return self.samples // self.minibatches

  def where(self, step: int) -> tuple[int, int]:
    """(rollout batch, index of the step inside it)."""
    return divmod(step, self.steps_per_rollout)

  def minibatch_rows(self, step: int) -> np.ndarray:
    """The rollout-batch rows step `step` trains on: epoch e's permutation of all rows, in
    consecutive slices of `rows`."""
    rollout, index = self.where(step)
    epoch, part = divmod(index, self.minibatches)
    order = np.random.default_rng([self.seed, rollout, epoch]).permutation(self.samples)
    return np.sort(order[part * self.rows:(part + 1) * self.rows])


class Store:
  """Rollout batches as .npz files in `directory`: rollout_00000012.npz, written atomically, the
  newest KEEP kept."""

  def __init__(self, directory: str, keep: int = KEEP):
    self.directory, self.keep = directory, keep

  def path(self, rollout: int) -> str:
    return os.path.join(self.directory, f"rollout_{rollout:08d}.npz")

  def save(self, rollout: int, arrays: dict) -> None:
    os.makedirs(self.directory, exist_ok=True)
    tmp = self.path(rollout) + ".tmp"
    with open(tmp, "wb") as f:
      np.savez(f, **arrays)
    os.replace(tmp, self.path(rollout))
    saved = sorted(n for n in os.listdir(self.directory)
                   if n.startswith("rollout_") and n.endswith(".npz"))
    for name in saved[:-self.keep]:
      os.remove(os.path.join(self.directory, name))

  def load(self, rollout: int, step: int) -> dict:
    path = self.path(rollout)
    if not os.path.isfile(path):
      raise config_lib.ConfigError(
          f"step {step} trains on rollout batch {rollout}, sampled before this run resumed, and "
          f"{path} is gone (the newest {self.keep} are kept): resume from a checkpoint at a "
          "rollout boundary (a step that is a multiple of posttrain.ppo_epochs x minibatches)")
    with np.load(path) as f:
      return {k: f[k] for k in f.files}
