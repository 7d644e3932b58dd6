"""configs/small_20m.py with float32 or bfloat16 compute (ARG), parameters kept in float32.

The model and data are copied from configs/small_20m.py (not imported) so that the study stays
reproducible when small_20m changes. The batch is cut from 16 x 256 to 8 x 128 tokens (1,024 a step; 8 rows
so that the config also validates on 8 devices) and the run to STEPS steps, so that both runs fit in about
15 minutes on a 2-core CPU; every step's loss is logged (the
divergence is measured step by step) and the eval loss every EVAL_EVERY steps. `quick` swaps in a
2-layer d_model 32 model and 4 steps (the test's budget); it is not a result."""

from jaxtrain.config import default_config

ARGS = ("float32", "bfloat16")
STEPS, EVAL_EVERY, WARMUP = 30, 10, 5


def get_config(arg=None, steps: int = STEPS, quick: bool = False):
  c = default_config()
  c.model.update(vocab_size=256, d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, head_dim=64, d_ff=1536,
                 max_seq_len=256, scan_layers=False)
  c.model.update(param_dtype="float32", compute_dtype=arg or "float32")
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=steps, batch_size=8, seq_len=128, log_every=1, eval_every=min(EVAL_EVERY, steps),
                 eval_batches=2)
  c.optim.update(lr=1e-3, warmup_steps=max(1, round(WARMUP * steps / STEPS)))
  if quick:
    c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64)
    c.train.update(batch_size=2, seq_len=64, eval_every=2, eval_batches=1)
  return c
