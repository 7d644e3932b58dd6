"""The tiny model on a real corpus through the text pipeline: prepare -> cache -> grain -> packed batches.

  python -m jaxtrain prepare --config=configs/text_tiny.py --workdir=runs/text_tiny
  python -m jaxtrain train   --config=configs/text_tiny.py --workdir=runs/text_tiny

`--config.data.path=PATH_OR_GLOB[@W][,PATH@W...]` names the corpus (text, .jsonl, .parquet,
ArrayRecord, a saved HF dataset, or a weighted mixture). By default: the Python standard library's
own .py sources (found through sysconfig), real text present wherever Python is."""

import os
import sysconfig

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=264, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, scan_layers=False)
  c.data.update(kind="text", path=os.path.join(sysconfig.get_paths()["stdlib"], "*.py"), tokenizer="byte",
                eval_fraction=0.02, packing="first_fit")
  c.train.update(steps=300, batch_size=32, seq_len=128, log_every=20, eval_every=100, eval_batches=4)
  c.optim.update(lr=3e-3, warmup_steps=30)
  c.sample.update(prompt="def ", max_new_tokens=64, temperature=0.8, top_k=20)
  return c
