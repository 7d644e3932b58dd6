"""Context parallelism at 16K tokens: a tiny model whose rows are split over 8 context shards (each holds two
1K-token chunks, causally balanced; jaxtrain/model/context.py); no remat (the activations of a model this
small are a few MB at 16K; recomputing the forward cost a fifth of each step).

On CPU, model.attention=auto picks blockwise attention at this length (memory linear in length; the
materialized [L/8, L] scores per head reached 18 GB over the 8 virtual devices): ~48 s a step on 2 cores, loss
5.595 -> 5.185 in 18 steps (tests/model/test_context.py, slow; ~65 s a step with remat=full)."""

from jaxtrain.config import default_config

SEQ_LEN = 16384


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=SEQ_LEN, scan_layers=False, remat="none")
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=200, batch_size=1, seq_len=SEQ_LEN, log_every=10, eval_every=100, eval_batches=1)
  c.optim.update(lr=3e-3, warmup_steps=20, schedule="cosine")
  c.mesh.update(data=-1, context=8)
  c.sample.update(prompt="< 17 4 99 120 3 56 8 150 42 77 19 63 |", max_new_tokens=16, temperature=0.0, top_k=0)
  return c
