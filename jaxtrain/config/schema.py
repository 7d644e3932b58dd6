"""The config schema: every key and its default, assembled from the sections (model.py, data.py,
train.py, posttrain.py, optim.py, comm.py, mesh.py, checkpoint.py, sample.py, eval.py; each keeps
its defaults, the choices its keys take and its checks together). No jax import here.

A config file in `configs/` starts from `default_config()` and changes values; `checks.validate`
says whether the result can run."""

import ml_collections

from jaxtrain.config import (checkpoint, comm, data, eval as eval_section, mesh, model, optim,
                             posttrain, sample, train)

# (low, high, whether low itself is allowed) for float settings; high is inclusive unless math.inf.
FLOAT_RANGES = {**model.RANGES, **data.RANGES, **train.RANGES, **posttrain.RANGES, **optim.RANGES,
                **comm.RANGES, **sample.RANGES}


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = model.model_defaults()
  c.data = data.data_defaults()
  c.train = train.train_defaults()
  c.posttrain = posttrain.posttrain_defaults()
  c.optim = optim.optim_defaults()
  c.comm = comm.comm_defaults()
  c.diloco = comm.diloco_defaults()
  c.mesh = mesh.mesh_defaults()
  c.checkpoint = checkpoint.checkpoint_defaults()
  c.sample = sample.sample_defaults()
  c.eval = eval_section.eval_defaults()
  return c
