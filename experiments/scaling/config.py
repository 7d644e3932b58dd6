"""Three model sizes, ~0.43M -> ~20.6M -> ~99M parameters (ARG), on the same data, batch and step budget;
and DEVICE_MODEL's run that run.py repeats on 1, 2, 4 and 8 devices (data parallel, `mesh.data=-1`).

tiny and small_20m's models are copied from configs/tiny.py and configs/small_20m.py (not imported) so
that the study stays reproducible when they change; base_100m (d_model 768, 12 layers, 12 heads of 64,
SwiGLU d_ff 2560) exists only here. Each size keeps its own peak learning rate (tiny 3e-3, small_20m 1e-3,
base_100m 6e-4, AdamW, cosine over STEPS with WARMUP steps). All sizes see the same 8 x 32-token batches
(256 tokens a step; 8 rows so that the configs validate on 8 devices), so that base_100m fits the study's
20 minutes on a 2-core CPU; the device runs use
tiny's own 32 x 128 batch split over the devices. TARGET is the loss the time-to-loss column waits for
(a SMOOTH-step running mean of the training loss). `quick` shrinks every model to d_model <= 64 and the
runs to 3 steps (the test's budget); it is not a result."""

from jaxtrain.config import default_config

ARGS = ("tiny", "small_20m", "base_100m")
MODELS = {  # name -> (model keys, peak learning rate)
    "tiny": (dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384), 3e-3),
    "small_20m": (dict(d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, head_dim=64, d_ff=1536), 1e-3),
    "base_100m": (dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, d_ff=2560), 6e-4),
}
QUICK = {  # the same three names, tiny stand-ins for the test
    "tiny": dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64),
    "small_20m": dict(d_model=48, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=24, d_ff=96),
    "base_100m": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=128),
}
DEVICES = (1, 2, 4, 8)
QUICK_DEVICES = (1, 8)  # --quick: the ends only
DEVICE_MODEL = "tiny"
STEPS, WARMUP = 20, 4
DEVICE_STEPS = 20
TARGET, SMOOTH = 5.45, 5


def get_config(arg=None, steps: int = STEPS, quick: bool = False, devices_run: bool = False):
  """The size `arg` (default tiny); `devices_run`: with the device runs' batch (32 x 128) instead."""
  name = arg or "tiny"
  model, lr = MODELS[name]
  c = default_config()
  c.model.update(vocab_size=256, max_seq_len=256, scan_layers=False, **(QUICK[name] if quick else model))
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=steps, batch_size=8, seq_len=32, log_every=1, eval_every=0)
  if devices_run:
    c.train.update(batch_size=8 if quick else 32, seq_len=32 if quick else 128)
  c.optim.update(lr=lr, warmup_steps=max(1, round(WARMUP * steps / STEPS)), schedule="cosine")
  return c
