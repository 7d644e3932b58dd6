"""A very small model trained long enough for several failures; ARG picks the save policy of the one checkpoint tier.

The model (tests/fixtures.py's tiny_config, copied) is small so that a training run and its restarts cost seconds:
the study is about when saves happen and what a failure throws away, not about the model. `fixed_N` saves every
N steps; `adaptive_MIN_MAX` is checkpoint.adaptive (jaxtrain/checkpoint/policy.py: MIN steps after a warning sign,
doubling after each calm save up to MAX); adaptive_10_200 is its default."""

from jaxtrain.config import default_config

ARGS = ("fixed_5", "fixed_10", "fixed_20", "fixed_40", "adaptive_5_40", "adaptive_10_200")
STEPS = 300


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                 max_seq_len=32)
  c.data.update(symbols=40, max_symbols=12, stop_prob=0.2)
  c.train.update(steps=STEPS, batch_size=8, seq_len=16, log_every=1, eval_every=0)
  c.optim.update(warmup_steps=10, lr=1e-2)
  c.mesh.update(data=-1)
  kind, *numbers = (arg or "adaptive_10_200").split("_")
  if kind == "fixed":
    c.checkpoint.every_steps = int(numbers[0])
  else:
    c.checkpoint.update(adaptive=True, adaptive_min_steps=int(numbers[0]), adaptive_max_steps=int(numbers[1]))
  c.checkpoint.keep = 2
  return c
