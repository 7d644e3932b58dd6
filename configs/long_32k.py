"""Context parallelism at 32K tokens: long_16k's tiny model, rows split over 4 context shards (each holds two
4K-token chunks, causally balanced; jaxtrain/model/context.py) and the batch over the remaining data shards
(2 on 8 devices)."""

import os

from jaxtrain.config_files import load_config_file

SEQ_LEN = 32768


def get_config(arg=None):
  del arg
  c = load_config_file(os.path.join(os.path.dirname(__file__), "long_16k.py"))
  c.model.max_seq_len = c.train.seq_len = SEQ_LEN
  c.train.batch_size = 2
  c.mesh.context = 4
  return c
