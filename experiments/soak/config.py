"""The soak's run (tools/soak.py): configs/tiny.py (loaded, so the soak follows tiny) with a short
warmup, a checkpoint every 10 steps (the newest 3 kept), a 10 s peer timeout, no evaluation and no
sample; the soak sets train.steps (from a calibration) and train.nan_steps (its drawn NaN batches) on
the command line."""

from jaxtrain.config_files import load_config_file

EVERY, PEER_TIMEOUT_S = 10, 10.0


def get_config(arg=None):
  del arg
  c = load_config_file("tiny")
  c.train.update(log_every=10, eval_every=0, peer_timeout_s=PEER_TIMEOUT_S)
  c.optim.update(warmup_steps=5)
  c.checkpoint.update(every_steps=EVERY, keep=3)
  return c
