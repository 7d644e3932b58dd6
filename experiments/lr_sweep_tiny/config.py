"""configs/tiny.py, shortened for a learning-rate sweep: 150 steps at batch 16; ARG is the peak learning rate.

The model and data are copied from configs/tiny.py (not imported) so that the study stays
reproducible when tiny changes. ARGS are the sweep's points; run.py trains one run per point."""

from jaxtrain.config import default_config

ARGS = ("1e-3", "3e-3", "1e-2")


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, scan_layers=False)
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=150, batch_size=16, seq_len=128, log_every=10, eval_every=50, eval_batches=4)
  c.optim.update(lr=float(arg or "3e-3"), warmup_steps=20, schedule="cosine")
  return c
