"""Learning-rate schedules: warmup + cosine, warmup-stable-decay (Hu et al., 2024), constant."""

import optax


def warmup_cosine(lr, steps, warmup, min_ratio):
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * min_ratio)


def warmup_stable_decay(lr, steps, warmup, min_ratio, decay_fraction):
  """Linear warmup, a flat phase, then a linear decay over the last `decay_fraction` of steps."""
  decay = max(1, int(steps * decay_fraction))
  stable = max(0, steps - warmup - decay)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup),
       optax.constant_schedule(lr),
       optax.linear_schedule(lr, lr * min_ratio, decay)],
      [warmup, warmup + stable])


def warmup_constant(lr, warmup):
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup),
                               optax.constant_schedule(lr)], [warmup])


def make_schedule(o, steps: int):
  """The schedule named by `optim.schedule`. A run shorter than its warmup (config validation lets
  only a one-step run through, `--config.train.steps=1` on any config) takes its steps at the peak
  rate."""
  warmup = min(o.warmup_steps, max(steps - 1, 0))
  schedules = {
      "cosine": lambda: warmup_cosine(o.lr, steps, warmup, o.min_lr_ratio),
      "wsd": lambda: warmup_stable_decay(o.lr, steps, warmup, o.min_lr_ratio, o.decay_fraction),
      "constant": lambda: warmup_constant(o.lr, warmup),
  }
  return schedules[o.schedule]()
