"""When to save: Orbax save-decision policies built from the config, plus an adaptive one.

The adaptive policy saves more often while training is unstable and less often while it
converges smoothly. The loop feeds it each step's loss, gradient norm and skipped-step count
(`observe`); Orbax asks it `should_save`. Every change of interval is returned by `observe`
so that the loop logs it. It also marks *good* steps, which `KeepGood` preserves, so that a
rollback after a divergence has a step from before it. Hardware health (train/hardware.py) caps
the interval (`hardware`). All inputs are global values, so every process decides alike.
"""

import collections
import dataclasses
import datetime
import math
import statistics
from typing import Callable

from orbax.checkpoint import checkpoint_managers as policies


@dataclasses.dataclass
class AdaptivePolicy(policies.SaveDecisionPolicy):
  """Interval between saves: `min_steps` after a warning sign, doubling after each calm save
  up to `max_steps`.

  Warning signs: a loss above (1 + spike) times the median of the last `window` losses, a
  gradient norm above 3x its median, a non-finite loss, or a skipped (non-finite) update.
  A saved step is good when no sign came since the save before it nor at the step after it
  (whose loss is the first computed from the saved params); `good` lists them, oldest first."""
  min_steps: int
  max_steps: int
  spike: float = 0.1
  window: int = 32

  def __post_init__(self):
    self.interval = self.min_steps
    self.cap = self.max_steps  # the hardware risk's bound on the interval
    self._losses = collections.deque(maxlen=self.window)
    self._grad_norms = collections.deque(maxlen=self.window)
    self._skipped = 0
    self._calm_since_save = True
    self.good: list[int] = []
    # saved after a calm stretch; good unless the next step shows a sign
    self._unjudged: list[int] = []

  def observe(self, step: int, loss: float, grad_norm: float, skipped: float) -> str | None:
    """Takes one step's global values; returns why the interval changed, or None."""
    reason = None
    if not math.isfinite(loss):
      reason = f"non-finite loss at step {step}"
    elif skipped > self._skipped:
      reason = f"update skipped at step {step}"
    elif len(self._losses) >= 8 and loss > (1 + self.spike) * statistics.median(self._losses):
      median = statistics.median(self._losses)
      reason = f"loss spike at step {step}: {loss:.4g} > {1 + self.spike:g} x median {median:.4g}"
    elif len(self._grad_norms) >= 8 and grad_norm > 3 * statistics.median(self._grad_norms):
      reason = (f"grad-norm spike at step {step}: {grad_norm:.4g} > 3 x median "
                f"{statistics.median(self._grad_norms):.4g}")
    self._skipped = skipped
    if math.isfinite(loss):
      self._losses.append(loss)
    if math.isfinite(grad_norm):
      self._grad_norms.append(grad_norm)
    self._judge(step, calm=reason is None)
    if reason is None:
      return None
    self._calm_since_save = False
    if self.interval == self.min_steps:
      return None
    self.interval = self.min_steps
    return f"interval -> {self.interval} steps ({reason})"

  def _judge(self, step: int, calm: bool):
    """A sign condemns every unjudged save (the newest made the state that showed it); calm confirms
    those before."""
    judged = [s for s in self._unjudged if s < step] if calm else []
    self.good += judged
    self._unjudged = [s for s in self._unjudged if s >= step] if calm else []

  def newest_good(self, steps) -> int | None:
    """The newest good step among `steps` (those on disk)."""
    steps = set(steps)
    return max((s for s in self.good if s in steps), default=None)

  def hardware(self, step: int, risk: float, why: str) -> str | None:
    """Takes the run's hardware risk in [0, 1]: the interval is at most
    max(min_steps, floor(max_steps x (1 - risk))) until the next reading; returns why the interval
    shortened, or None."""
    self.cap = max(self.min_steps, math.floor(self.max_steps * (1 - risk)))
    if self.interval <= self.cap:
      return None
    self.interval = self.cap
    return f"interval -> {self.interval} steps (hardware risk {risk:.2f} at step {step}: {why})"

  def saved(self, step: int) -> str | None:
    """Called after each save of this tier: a calm stretch doubles the interval (up to the hardware
    cap)."""
    calm, self._calm_since_save = self._calm_since_save, True
    if calm:
      self._unjudged.append(step)
    if not calm or self.interval >= min(self.max_steps, self.cap):
      return None
    self.interval = min(2 * self.interval, self.max_steps, self.cap)
    return f"interval -> {self.interval} steps (calm since the last save)"

  def should_save(self, step, previous_steps, *, context) -> bool:
    if context.is_saving_in_progress:
      return False
    last = previous_steps[-1].step if previous_steps else 0
    return step.step - last >= self.interval


def save_policy(every_steps: int, every_seconds: float, adaptive: AdaptivePolicy | None = None):
  """Any of: every n steps, at least every s seconds (skipped while a save is in flight), adaptive.
  None when nothing is configured (the tier then saves only when forced)."""
  chosen = []
  if every_steps:
    chosen.append(policies.FixedIntervalPolicy(every_steps))
  if every_seconds:
    chosen.append(policies.ContinuousCheckpointingPolicy(minimum_interval_secs=every_seconds))
  if adaptive is not None:
    chosen.append(adaptive)
  if not chosen:
    return None
  return chosen[0] if len(chosen) == 1 else policies.AnySavePolicy(chosen)


@dataclasses.dataclass
class KeepGood(policies.PreservationPolicy):
  """Preserves the newest step that `adaptive` marked good, however many saves came after it."""
  adaptive: AdaptivePolicy

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    steps = [c.step for c in checkpoints]  # all the manager holds, the step being saved included
    # older ones were deleted
    self.adaptive.good = [s for s in self.adaptive.good if s >= min(steps, default=0)]
    good = self.adaptive.newest_good(steps)
    return [step == good for step in steps]


@dataclasses.dataclass
class Attempt:
  """A save that failed, as Orbax's policies see a save (a PolicyCheckpointInfo)."""
  step: int
  time: datetime.datetime
  metrics: None = None


@dataclasses.dataclass
class Settled(policies.SaveDecisionPolicy):
  """`policy`, told whether a save is in flight by `in_flight()` (Orbax's own flag stays set after a
  save that failed in its blocking part, orbax-checkpoint 0.12, which stopped timed and adaptive
  saves for good), and counting the interval from a failed save (`failed(step)`) as from a save: the
  retry comes one interval later, not every step."""
  policy: policies.SaveDecisionPolicy
  in_flight: Callable[[], bool]
  attempt: Attempt | None = None

  def failed(self, step: int):
    self.attempt = Attempt(step, datetime.datetime.now(datetime.timezone.utc))

  def should_save(self, step, previous_steps, *, context) -> bool:
    context = dataclasses.replace(context, is_saving_in_progress=self.in_flight())
    if self.attempt is not None and (not previous_steps or
                                     self.attempt.step > previous_steps[-1].step):
      previous_steps = [*previous_steps, self.attempt]
    return self.policy.should_save(step, previous_steps, context=context)


def preservation_policy(keep: int, keep_every_steps: int = 0,
                        adaptive: AdaptivePolicy | None = None):
  """Keep the newest `keep` steps, every step divisible by `keep_every_steps`,
  and the newest good step."""
  kept = [policies.LatestN(keep)]
  if keep_every_steps:
    kept.append(policies.EveryNSteps(keep_every_steps))
  if adaptive is not None:
    kept.append(KeepGood(adaptive))
  return kept[0] if len(kept) == 1 else policies.AnyPreservationPolicy(kept)
