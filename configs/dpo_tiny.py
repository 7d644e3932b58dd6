"""DPO on a tiny decoder (train.task="dpo", jaxtrain/posttrain/dpo.py); posttrain.loss="ipo" or "simpo"
(reference-free) for the variants.

The frozen reference is the checkpoint.init_from params (normally an SFT run: train sft_tiny first and set
--config.checkpoint.init_from=ITS_WORKDIR); without one, as here, policy and reference start from the same
random init. Data: as rm_tiny (synthetic pairs in WORKDIR/posttrain_data/pairs.jsonl unless
posttrain.train_path is set)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                 max_seq_len=32, scan_layers=False)
  c.data.update(kind="synthetic", symbols=40, max_symbols=12)
  c.train.update(task="dpo", steps=300, batch_size=16, seq_len=32, log_every=20, eval_every=100, eval_batches=4)
  c.posttrain.update(synthetic_examples=2000, eval_fraction=0.1, loss="dpo", beta=0.1)
  c.optim.update(lr=1e-3, warmup_steps=10, schedule="cosine")
  c.sample.update(prompt="< 5 12 7 30 |", max_new_tokens=6, temperature=0.0, top_k=0)
  return c
