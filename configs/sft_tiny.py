"""Supervised fine-tuning of a tiny decoder (train.task="sft", jaxtrain/posttrain/sft.py).

Data: posttrain.train_path (JSONL prompt/completion or chat messages); when it is empty, as here, a synthetic
task is written into WORKDIR/posttrain_data/sft.jsonl: reverse a list of symbols of the synthetic language
("< 5 12 7 |" -> "7 12 5 >"), 10% held out. To fine-tune a pre-trained run, set checkpoint.init_from to its
workdir (same model section)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                 max_seq_len=64, scan_layers=False)
  c.data.update(kind="synthetic", symbols=40, max_symbols=12)  # the tokenizer: the synthetic language's symbols
  c.train.update(task="sft", steps=300, batch_size=16, seq_len=64, log_every=20, eval_every=100, eval_batches=4)
  c.posttrain.update(synthetic_examples=2000, eval_fraction=0.1)
  c.optim.update(lr=3e-3, warmup_steps=10, schedule="cosine")
  c.sample.update(prompt="< 5 12 7 30 |", max_new_tokens=6, temperature=0.0, top_k=0)
  return c
