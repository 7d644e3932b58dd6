"""Task evaluation inside the training loop (eval.tasks every eval.every_steps): the loop's params
scored where they lie, on the training mesh, with one compiled scoring program for the whole run.

`InLoopEval(cfg, workdir, run, state)` is what train/loop.py receives (train(evaluator=...); by
default built here when eval.tasks is set): `due(step, is_last)` says whether an evaluation is due
and not already logged, `__call__(step, params, extra)` returns the row's `eval/<task>/<metric>`
columns. Resumable: the steps whose rows in metrics.jsonl already hold every task's columns are not
evaluated again (a run resumed from an older checkpoint recomputes those steps, not their
evaluations)."""

import json

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.config import eval as eval_config
from jaxtrain.eval import score, tasks as tasks_lib
from jaxtrain.model import ModelConfig
from jaxtrain.train import goodput as goodput_lib, peers, sampling

PREFIX = "eval/"


def columns(task: str, metrics: dict) -> dict:
  """{eval/<task>/<metric>: value} of one task's metrics."""
  return {f"{PREFIX}{task}/{k}": v for k, v in metrics.items()}


def logged_steps(workdir: str, names: list[str]) -> set[int]:
  """The steps of metrics.jsonl rows that hold a column of every task in `names`, as process 0
  reads them: it alone writes metrics.jsonl, and every process must skip the same evaluations (the
  scoring is collective: a process that evaluated alone would wait on the others forever)."""
  out = []
  if jax.process_index() == 0:
    out = [int(row["step"]) for row in goodput_lib.history(workdir) if "step" in row and all(
        any(k.startswith(f"{PREFIX}{n}/") for k in row) for n in names)]
  return set(json.loads(peers.agree("eval_logged_steps", json.dumps(sorted(set(out))))))


class InLoopEval:
  """The task files of eval.tasks, loaded and checked at startup (a bad one is one ConfigError
  line), scored by the training params on `run.mesh` every eval.every_steps and at the last step."""

  def __init__(self, cfg, workdir: str, run, state):
    self.every = eval_config.every_steps(cfg)
    e = cfg.eval
    self.tasks = tasks_lib.load_tasks(eval_config.task_paths(cfg), "eval.tasks")
    self.tokenizer = sampling.load_tokenizer(cfg, workdir)
    self.limit, self.seed = e.limit or None, e.seed
    self.num_fewshot = None if e.num_fewshot == -1 else e.num_fewshot  # None: each task's own
    self.logged = logged_steps(workdir, [t.name for t in self.tasks])
    # rows and seq_len as jaxtrain.evaluate's defaults: the same packing, so the same numbers
    self.scorer = score.Scorer(ModelConfig.from_config(cfg.model), state.params, state.extra,
                               mesh=run.mesh, mesh_rules=cfg.mesh.rules)
    self.shardings = jax.tree.map(lambda a: a.sharding, self.scorer.params)
    self.scorer.params = self.scorer.extra = None  # given at each evaluation (__call__)

  def due(self, step: int, is_last: bool) -> bool:
    return (step % self.every == 0 or is_last) and step not in self.logged

  def __call__(self, step: int, params, extra) -> dict:
    """The row's columns for `step`, scored by `params` (moved only where the scorer's shardings
    differ from the training ones)."""
    self.scorer.params = jax.device_put(params, self.shardings)
    self.scorer.extra = jax.device_put(extra or {}, NamedSharding(self.scorer.mesh, P()))
    row = {}
    for task in self.tasks:
      row.update(columns(task.name, tasks_lib.run(task, self.scorer, self.tokenizer,
                                                  self.num_fewshot, self.seed, self.limit)))
    self.logged.add(step)
    # hold no params between evaluations: a copy (where shardings differ) would stay live all run
    self.scorer.params = self.scorer.extra = None
    return row


def from_config(cfg, workdir: str, run, state):
  """The loop's evaluator for eval.tasks, or None when it names none."""
  if not eval_config.task_paths(cfg):
    return None
  return InLoopEval(cfg, workdir, run, state)
