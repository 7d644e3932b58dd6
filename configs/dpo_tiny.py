"""DPO on a tiny decoder (train.task="dpo", jaxtrain/posttrain/dpo.py); posttrain.loss="ipo" or "simpo"
(reference-free) for the variants.

The frozen reference is the checkpoint.init_from params (normally an SFT run: train sft_tiny first and set
--config.checkpoint.init_from=ITS_WORKDIR); without one, as here, policy and reference start from the same
random init. Data: as rm_tiny (synthetic pairs in WORKDIR/posttrain_data/pairs.jsonl unless
posttrain.train_path is set)."""

import os

from jaxtrain.config_files import load_config_file


def get_config(arg=None):
  del arg
  c = load_config_file(os.path.join(os.path.dirname(__file__), "rm_tiny.py"))  # its model, data and schedule
  c.train.task = "dpo"
  c.posttrain.update(loss="dpo", beta=0.1)
  return c
