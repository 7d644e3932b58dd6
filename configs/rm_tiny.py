"""A tiny reward model (train.task="rm", jaxtrain/posttrain/reward.py): a scalar head on the decoder's last
hidden state, Bradley-Terry loss on preference pairs, held-out accuracy.

Data: posttrain.train_path (JSONL prompt/chosen/rejected); when it is empty, as here, synthetic pairs are
written into WORKDIR/posttrain_data/pairs.jsonl: chosen = the reversal of the prompt's symbols, rejected =
the reversal with one symbol changed. Load the result with jaxtrain.load_reward_model(workdir)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                 max_seq_len=32, scan_layers=False)
  c.data.update(kind="synthetic", symbols=40, max_symbols=12)
  c.train.update(task="rm", steps=300, batch_size=16, seq_len=32, log_every=20, eval_every=100, eval_batches=4)
  c.posttrain.update(synthetic_examples=2000, eval_fraction=0.1)
  c.optim.update(lr=1e-3, warmup_steps=10, schedule="cosine")
  c.sample.update(prompt="< 5 12 7 30 |", max_new_tokens=6, temperature=0.0, top_k=0)
  return c
