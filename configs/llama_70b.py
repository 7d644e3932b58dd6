"""Llama 3 70B's shape (70.6B parameters): GQA 64/8, head dim 128, d_ff 28672, untied embeddings,
rope theta 500k. Float32 parameters and AdamW moments: 12 bytes a parameter, 49.3 GiB a chip of
state on 16 chips.

Laid out for 16 TPU v5p chips (`--target=tpu-v5p:2x2x4`) as fsdp 16, one 8192-token row a chip:
XLA:TPU fits it in 89.63 of 95 GiB (compiled, not executed). As 4 pipeline stages x fsdp 4
(`--config.mesh.stage=4`, 4 microbatches) it does not fit: 109.48 GiB of temporaries, most of them
f32 copies of each stage's gradient, which the pipeline accumulates over its iterations
(tests/targets/test_configs.py, benchmarks/RESULTS.md). With twice the batch
(`--config.train.batch_size=32`) fsdp 16 is refused (99.44 GiB) and fits with
`--config.train.offload=activations` (87.02 GiB; the 80 layer inputs, 20 GiB a chip, on the
host)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                 head_dim=128, d_ff=28672, max_seq_len=8192, rope_theta=500000.0,
                 tie_embeddings=False, norm_eps=1e-5, param_dtype="float32",
                 compute_dtype="bfloat16", remat="full", scan_layers=True)
  c.data.update(kind="synthetic", symbols=4000, max_symbols=500, stop_prob=1 / 256)
  c.train.update(steps=10000, batch_size=16, seq_len=8192, log_every=10, eval_every=1000,
                 pipeline_microbatches=4, cross_entropy="chunked")
  c.optim.update(lr=1.5e-4, warmup_steps=1000, schedule="wsd", weight_decay=0.1)
  c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp_tp")
  c.checkpoint.every_steps = 500
  return c
