"""GPT-2 small's shape (124M parameters) as a Llama-style model: SwiGLU with d_ff = 8/3 * 768."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, d_ff=2048,
                 max_seq_len=1024, tie_embeddings=True, compute_dtype="bfloat16", remat="none")
  c.data.update(kind="synthetic", symbols=2000, max_symbols=200, stop_prob=1 / 64)
  c.train.update(steps=5000, batch_size=64, seq_len=1024, log_every=20, eval_every=500)
  c.optim.update(lr=6e-4, warmup_steps=200, schedule="cosine", weight_decay=0.1)
  c.mesh.update(data=-1, fsdp=1, rules="fsdp")
  c.checkpoint.every_steps = 1000
  c.sample.update(prompt="< 1 2 3 4 5 |", max_new_tokens=8, temperature=0.0, top_k=0)
  return c
