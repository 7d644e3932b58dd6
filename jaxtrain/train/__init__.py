"""Training: the train state, the pure step built around a loss, tasks (language modeling first), the loop.

`jaxtrain.train` is also callable: `jaxtrain.train(cfg, workdir)` runs `loop.train`, while
`jaxtrain.train.step.make_train_step` and the other modules stay reachable under the same name."""

import sys
import types

from jaxtrain.train.lm import LanguageModel
from jaxtrain.train.loop import train
from jaxtrain.train.sampling import sample
from jaxtrain.train.state import TrainState, create_state
from jaxtrain.train.step import make_train_step
from jaxtrain.train.task import Task
from jaxtrain.train.workdir import load_config


class _CallableModule(types.ModuleType):
  """`jaxtrain.train(cfg, workdir, ...)` calls the loop; the package's attributes stay as they are."""

  def __call__(self, *args, **kwargs):
    return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__all__ = ["LanguageModel", "Task", "TrainState", "create_state", "load_config", "make_train_step", "sample",
           "train"]
