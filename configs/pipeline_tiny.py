"""`tiny` with 4 layers, pipelined over 4 stages (jaxtrain/model/pipeline.py): on 8 CPU devices, 4
stages x 2 data shards, each batch of a data shard cut into 4 microbatches (GPipe, 7 iterations a
pass).

Its unpipelined twin is the same config with `--config.mesh.stage=1` (the same model and parameters,
the batch over 8 data shards): their losses agree to float32 reassociation
(tests/model/test_pipeline.py::test_pipeline_tiny_trains_like_its_unpipelined_twin).
`pipeline_tiny:circular` runs the same model as 2 stages x 2 circular repeats (4 microbatches, 9
iterations a pass)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                 d_ff=384, max_seq_len=256, scan_layers=False)
  c.mesh.update(stage=4, data=-1)
  if arg == "circular":
    c.mesh.update(stage=2)
    c.model.update(pipeline_repeats=2)
    c.train.update(pipeline_microbatches=4)
  elif arg not in (None, ""):
    raise ValueError(f"pipeline_tiny: unknown variant {arg!r} (use circular)")
  # the synthetic copy language of `tiny`
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=400, batch_size=32, seq_len=128, log_every=20, eval_every=100,
                 eval_batches=4)
  c.optim.update(lr=3e-3, warmup_steps=10, schedule="cosine")  # short: a 20-step run works too
  c.sample.update(prompt="< 17 4 99 120 3 56 8 150 42 77 19 63 |", max_new_tokens=16,
                  temperature=0.0, top_k=0)
  return c
