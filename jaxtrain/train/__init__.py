"""Training runs: the loop (the composition root), sampling from a run, its workdir, goodput,
preemption.

`jaxtrain.train` is also callable: `jaxtrain.train(cfg, workdir)` runs `loop.train`, while its
modules stay reachable under the same name. The step, state and tasks it trains are
`jaxtrain.core`'s (re-exported here)."""

import sys
import types

from jaxtrain.core.lm import LanguageModel
from jaxtrain.core.state import TrainState, create_state
from jaxtrain.core.step import make_train_step
from jaxtrain.core.task import Task
from jaxtrain.train.loop import train
from jaxtrain.train.sampling import sample
from jaxtrain.train.workdir import load_config


class _CallableModule(types.ModuleType):
  """`jaxtrain.train(cfg, workdir, ...)` calls the loop; the package's attributes stay as they
  are."""

  def __call__(self, *args, **kwargs):
    return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__all__ = [
    "LanguageModel", "Task", "TrainState", "create_state", "load_config", "make_train_step",
    "sample", "train"
]
