"""Mixtral 8x7B's shape (46.7B parameters, 12.9B active): 32 layers, every one 8 SwiGLU experts,
top-2 softmax routing renormalized; GQA 32/8, rope theta 1e6, untied embeddings.

Experts over the `expert` axis (8 devices per expert group), parameters over fsdp."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                 d_ff=14336, max_seq_len=32768, rope_theta=1e6, tie_embeddings=False, norm_eps=1e-5,
                 param_dtype="float32", compute_dtype="bfloat16", remat="full", scan_layers=True,
                 n_experts=8, top_k=2, router="softmax", renormalize=True, dispatch="dropless",
                 aux_loss_weight=0.02, router_z_weight=0.001)
  c.data.update(kind="synthetic", symbols=4000, max_symbols=500, stop_prob=1 / 256)
  c.train.update(steps=10000, batch_size=256, seq_len=4096, log_every=10, eval_every=1000)
  c.optim.update(lr=3e-4, warmup_steps=1000, schedule="wsd", weight_decay=0.1)
  c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1, rules="fsdp_ep")
  c.checkpoint.every_steps = 500
  return c
