"""A ~20M-parameter model for CPU throughput benchmarks (benchmarks/train_step.py) and short runs."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=256, d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, head_dim=64, d_ff=1536,
                 max_seq_len=256, scan_layers=False)
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=300, batch_size=16, seq_len=256, log_every=10, eval_every=100, eval_batches=2)
  c.optim.update(lr=1e-3, warmup_steps=30)
  c.sample.update(prompt="< 17 4 99 120 3 56 8 150 42 77 19 63 |", max_new_tokens=16, temperature=0.0, top_k=0)
  return c
