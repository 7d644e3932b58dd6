"""The pipeline study's runs: one model (configs/pipeline_tiny.py's widths, 8 layers) and one batch
(32 rows of 128 tokens), laid out on 8 devices as the unpipelined twin (data 8) or as S stages x the
rest data, R circular repeats, M microbatches per data shard. ARG "S4_R1_M8": 4 stages, GPipe, 8
microbatches; "S1": no stages.

Copied, not imported, from configs/pipeline_tiny.py so that the study stays reproducible when that
config changes."""

from jaxtrain.config import default_config

ARGS = ("S1", "S2_R1_M2", "S2_R1_M4", "S2_R1_M8", "S4_R1_M4", "S4_R1_M8", "S4_R1_M16", "S2_R2_M4",
        "S2_R4_M4", "S4_R2_M4")


def parse(arg: str) -> tuple[int, int, int]:
  """"S4_R2_M8" -> (stages, repeats, microbatches); "S1" -> (1, 1, 1)."""
  parts = dict((p[0], int(p[1:])) for p in (arg or "S1").split("_"))
  return parts["S"], parts.get("R", 1), parts.get("M", 1)


def get_config(arg=None):
  stages, repeats, microbatches = parse(arg)
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32,
                 d_ff=384, max_seq_len=256, scan_layers=False, pipeline_repeats=repeats,
                 attention="xla")  # splash does not run in a stage: the same attention everywhere
  c.mesh.update(stage=stages, data=-1)
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=12, batch_size=32, seq_len=128, log_every=1, eval_every=0,
                 pipeline_microbatches=microbatches if stages > 1 else 0)
  c.optim.update(lr=3e-3, warmup_steps=2, schedule="cosine")
  return c
