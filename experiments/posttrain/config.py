"""The tiny byte-level model pre-trained on the addition language (jaxtrain/posttrain/exact.py):
`get_config(PATH)` with PATH the corpus (pretrain.jsonl, one problem a document through the text pipeline).

configs/text_tiny.py's model (d_model 128, 2 layers) with a 64-token context: a problem is at most 14
tokens (BOS 3+3 digits, '+', '=', 4 digits, EOS), packed first_fit about 5 to a row."""

from jaxtrain.config import default_config

DEFAULT_PATH = "runs/posttrain/exact/data/pretrain.jsonl"


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=264, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=64, scan_layers=False)
  c.data.update(kind="text", path=arg or DEFAULT_PATH, tokenizer="byte", eval_fraction=0.02, packing="first_fit")
  c.train.update(steps=800, batch_size=32, seq_len=64, log_every=50, eval_every=0)
  c.optim.update(lr=3e-3, warmup_steps=50, schedule="cosine")
  c.checkpoint.update(every_steps=200, keep=1, keep_every_steps=200)
  return c
