"""The default: a 2-layer model small enough to learn the synthetic copy language on a 2-core CPU
(its run time: benchmarks/RESULTS.md).

The language's exact entropy floor is logged as `entropy_floor`; tiny gets within 5% of it
(tests/train/test_loop.py::test_tiny_reaches_entropy_floor)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, scan_layers=False)
  # Almost every random half has 12 symbols (forced stop at 12, early stop 0.1%): the copy sits 13
  # tokens back, which one attention head with rotary positions learns in a few hundred steps.
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=400, batch_size=32, seq_len=128, log_every=20, eval_every=100, eval_batches=4)
  c.optim.update(lr=3e-3, warmup_steps=50, schedule="cosine")
  c.sample.update(prompt="< 17 4 99 120 3 56 8 150 42 77 19 63 |", max_new_tokens=16, temperature=0.0, top_k=0)
  return c
