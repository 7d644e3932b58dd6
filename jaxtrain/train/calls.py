"""Several optimizer steps per jitted call (train.steps_per_call = K): how many steps each call
runs.

A call of K steps is one program, a scan of the train step over K batches fed together
(builder.compile_call), bitwise the K steps one call each; it dispatches once instead of K times.
The loop sees the state only between calls, so a call ends where the state is needed: at a save, an
evaluation or a hardware check on a step interval, and at the run's last step. The steps that lead
up to such a step, when fewer than K remain before it, run one call each (the single-step program,
compiled when first needed); so do the last steps of a run shorter than a whole call. Policies that
decide by time or by what training looked like (checkpoint.every_seconds, adaptive tiers) are asked
between calls. Every step's metrics come back (one entry per step) and are logged as before.
Calls whose steps are traced at their positions (builder.overlapped: streaming DiLoCo with a delay)
start only at steps divisible by their length; a run resumed elsewhere takes single steps up to
the next such step.
"""

from jaxtrain import builder, config as config_lib
from jaxtrain.config import eval as eval_config


def intervals(cfg) -> tuple[int, ...]:
  """The step intervals at which the loop needs the state: the tiers' saves, the eval loss and the
  in-loop tasks, the hardware checks."""
  k, t = cfg.checkpoint, cfg.train
  every = (k.every_steps, k.fast_every_steps, k.health_every_steps, t.eval_every,
           eval_config.every_steps(cfg))
  return tuple(sorted({e for e in every if e}))


def size(step: int, cfg, every: tuple[int, ...]) -> int:
  """How many steps the call after `step` (the steps done) runs: train.steps_per_call, or 1 when
  a step it would pass through (not its last) needs the state, or the run ends within it."""
  k = cfg.train.steps_per_call
  if k == 1 or step + k > cfg.train.steps or (builder.overlapped(cfg) and step % k):
    return 1
  inner = range(step + 1, step + k)
  return 1 if any(n % e == 0 for e in every for n in inner) else k


def check_task(cfg, task) -> None:
  """One ConfigError line when train.steps_per_call > 1 and the task builds each step's batch from
  the state (core/task.py make_batch: RL's rollouts)."""
  if cfg.train.steps_per_call > 1 and not task.feeds_unchanged():
    raise config_lib.ConfigError(
        f"train.steps_per_call={cfg.train.steps_per_call}: the task {type(task).__name__} builds "
        f"each step's batch from the params between steps (make_batch); set train.steps_per_call=1")
