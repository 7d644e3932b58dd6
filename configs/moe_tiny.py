"""A small Mixture-of-Experts decoder (8 experts, top-2) that learns the synthetic copy language on
2 CPU cores; the dense `tiny` with d_ff = 2 x 192 has the same active parameters.

Capacity dispatch (factor 1.5): on CPU its step is faster than dropless (`--config.model.dispatch=dropless`,
tiled grouped matmul), coarse and `:fine` alike (benchmarks/RESULTS.md, "MoE dispatch for fine-grained experts").

`moe_tiny:fine` is the fine-grained variant at the same active size: 32 experts of a quarter the
width, top-8 (benchmarks/moe.py compares the three)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, scan_layers=False,
                 n_experts=8, top_k=2, d_ff_expert=192, dispatch="capacity", capacity_factor=1.5,
                 aux_loss_weight=0.01,
                 router_z_weight=0.001)
  if arg == "fine":
    c.model.update(n_experts=32, top_k=8, d_ff_expert=48)
  elif arg not in (None, ""):
    raise ValueError(f"moe_tiny: unknown variant {arg!r} (use fine)")
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=400, batch_size=32, seq_len=128, log_every=20, eval_every=100, eval_batches=4)
  c.optim.update(lr=3e-3, warmup_steps=50, schedule="cosine")
  c.mesh.update(data=-1, expert=1, rules="fsdp_ep")
  c.sample.update(prompt="< 17 4 99 120 3 56 8 150 42 77 19 63 |", max_new_tokens=16, temperature=0.0, top_k=0)
  return c
