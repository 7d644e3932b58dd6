"""Llama 3 8B's shape (8.03B parameters): GQA 32/8, head dim 128, untied embeddings, rope theta 500k."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                 d_ff=14336, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False, norm_eps=1e-5,
                 param_dtype="float32", compute_dtype="bfloat16", remat="full", scan_layers=True)
  c.data.update(kind="synthetic", symbols=4000, max_symbols=500, stop_prob=1 / 256)
  c.train.update(steps=10000, batch_size=256, seq_len=8192, log_every=10, eval_every=1000, microbatches=1)
  c.optim.update(lr=3e-4, warmup_steps=1000, schedule="wsd", weight_decay=0.1)
  c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp_tp")
  c.checkpoint.every_steps = 500
  return c
