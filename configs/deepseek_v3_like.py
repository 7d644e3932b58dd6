"""DeepSeek-V3's MoE layout on jaxtrain's attention (GQA instead of MLA): 61 layers, the first 3
dense (d_ff 18432), then 256 fine-grained routed experts (d_ff 2048) top-8 with sigmoid scores,
renormalized and scaled by 2.5, one shared expert, auxiliary-loss-free balancing (bias step 1e-3)
plus a tiny balance loss. 688B parameters, 54.8B active (DeepSeek-V3: 671B / 37B; the gap is
full GQA attention in place of MLA's low-rank projections).

Layout for 512 TPU v5p chips (v5p 8x8x8): experts over `expert` (8 ways, 32 experts a shard), every
weight over fsdp (64), two microbatches of 1 row a chip: XLA:TPU assigns 81.07 GiB of 95
(`python -m jaxtrain compile --config=configs/deepseek_v3_like.py --target=tpu-v5p:8x8x8`). On 256
chips nothing tried fits (the planner's best, fsdp 64 x expert 4 with 4 microbatches: 98 GiB), and
expert 256 with fsdp 1 replicated every dense weight (XLA:TPU refused 1.46 TB of temporaries).
Dropless dispatch sizes each shard's expert rows for the worst case (every token of the 8 shards to
one shard's experts): a wider expert axis grows that buffer."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128,
                 d_ff=18432, max_seq_len=4096, rope_theta=10000.0, tie_embeddings=False, norm_eps=1e-6,
                 param_dtype="float32", compute_dtype="bfloat16", remat="full", scan_layers=True,
                 n_experts=256, top_k=8, d_ff_expert=2048, n_shared_experts=1, router="sigmoid",
                 renormalize=True, route_scale=2.5, dispatch="dropless", moe_first_dense=3, moe_every=1,
                 aux_loss_weight=1e-4, router_z_weight=0.0, bias_update_rate=1e-3)
  c.data.update(kind="synthetic", symbols=4000, max_symbols=500, stop_prob=1 / 256)
  c.train.update(steps=10000, batch_size=1024, seq_len=4096, microbatches=2, log_every=10,
                 eval_every=1000)
  c.optim.update(lr=2.2e-4, warmup_steps=2000, schedule="wsd", weight_decay=0.1)
  c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1, rules="fsdp_ep")
  c.checkpoint.every_steps = 500
  return c
