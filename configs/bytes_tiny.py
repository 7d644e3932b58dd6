"""The tiny model on raw bytes of local text files: `--config=configs/bytes_tiny.py:PATH_OR_GLOB`.

Without ARG it reads the Python standard library's `json` package sources (real text present
wherever Python is). Each file is one document; about 5% of files are held out for evaluation."""

import os
import sysconfig

from jaxtrain.config import default_config


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=264, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, scan_layers=False)
  c.data.update(kind="bytes", path=arg or os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"),
                eval_fraction=0.2)
  c.train.update(steps=300, batch_size=16, seq_len=128, log_every=20, eval_every=100, eval_batches=2)
  c.optim.update(lr=3e-3, warmup_steps=30)
  c.sample.update(prompt="import ", max_new_tokens=48, temperature=0.8, top_k=20)
  return c
