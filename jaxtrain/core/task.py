"""What the loop trains: a *task* says where its batches come from, what its parameters and state
are, its summed loss and metrics, and how it is evaluated. Language-model pre-training (core/lm.py)
is the first task; post-training objectives (preference pairs, groups of samples, a frozen reference
model, a value head) are others, written without touching train/.

A batch is a dict of arrays whose leading axis is the batch ([B, L] tokens, [B, 2, L] pairs, [B, G,
L] groups, [B] scalars); `parallel.Feed` places any of them. Subclass `Task` and override `init`,
`loss` and `batches`; every other method has a default.
"""

import jax


class Task:
  """The defaults of a task; `batch_size` (global rows) must be set by the subclass."""
  batch_size: int
  tokens_per_batch: int = 0  # for tokens/s and MFU; 0: not reported
  flops_per_token: float = 0.0

  def init(self, rng) -> tuple[dict, dict, dict]:
    """(params, extra, task_state) with logical-axis boxes (nn.with_logical_partitioning): the
    trained parameters, non-trainable model collections updated outside the optimizer, and the
    task's own state (a frozen reference model, ...). The state's shardings follow from these
    boxes."""
    raise NotImplementedError

  def loss(self, params, batch: dict, extra: dict, task_state: dict):
    """(objective, sums): the objective summed over the batch's units, and a dict of sums with
    "count", the number of units (see core/step.py)."""
    raise NotImplementedError

  def batches(self, split: str, lo: int, hi: int):
    """An iterator over rows lo:hi of consecutive global batches of `split` ("train" or "eval"),
    with get_state() -> dict and set_state(dict) for exact resume."""
    raise NotImplementedError

  def init_from(self, params: dict, task_state: dict, load) -> tuple[dict, dict]:
    """(params, task_state) of a run started from `checkpoint.init_from`; `load(tree)` reads the
    checkpoint's leaves of `tree` (fresh unboxed arrays, the same paths, shapes and shardings;
    `load(tree, step)`: that step's, not the newest).
    Default: the params are loaded, the task state kept. A frozen reference loads a second copy; a
    new head keeps its fresh init."""
    return load(params), task_state

  def make_batch(self, params, extra: dict, task_state: dict, batch: dict, step: int) -> dict:
    """The training batch of `step` from the fed one (global, sharded over the data axes), on the
    host before the step, with the state's current params (as they are sharded; no copy). RL builds
    its batch here: rollouts from the prompts, rewards on the decoded text, advantages. It must
    return arrays laid out as a fed batch (parallel.batch_sharding), the same shapes every step, and
    be a function of its arguments (and the seed) for exact resume. Default: the fed batch,
    unchanged."""
    del params, extra, task_state, step
    return batch

  def feeds_unchanged(self) -> bool:
    """Whether make_batch is the default (the fed batch, unchanged): then several steps' batches can
    be fed together, before the steps run (train.steps_per_call)."""
    return type(self).make_batch is Task.make_batch

  def prepare(self, progress: bool) -> None:
    """Host-side work before the first batch (tokenizing a corpus); run on every process."""

  def metrics(self, sums: dict, parts: int) -> dict:
    """Step metrics from the loss's sums: by default each sum per unit, with "loss" first."""
    return {k: v / sums["count"] for k, v in sums.items() if k != "count"}

  def update_extra(self, extra: dict, sums: dict, parts: int) -> dict:
    """The non-trainable state after a step (default: unchanged)."""
    return extra

  def eval_sums(self, params, extra: dict, task_state: dict, batch: dict) -> dict:
    """Sums of one eval batch (default: the loss's sums)."""
    return self.loss(params, batch, extra, task_state)[1]

  def eval_metrics(self, sums: list[dict]) -> dict:
    """Eval results from the per-batch sums (host numpy): by default `eval_loss` per unit."""
    count = max(sum(float(s["count"]) for s in sums), 1.0)
    return {"eval_loss": sum(float(s["loss"]) for s in sums) / count}

  def constants(self) -> dict:
    """Values logged with every row (e.g. the data's exact entropy floor)."""
    return {}

  def sizes(self) -> dict:
    """Parameter counts to print at the start ({} prints nothing)."""
    return {}


def process_rows() -> tuple[int, int]:
  """(process index, process count), for tasks whose batches depend on them."""
  return jax.process_index(), jax.process_count()
