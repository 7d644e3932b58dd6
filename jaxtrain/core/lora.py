"""LoRA fine-tuning of any task (model.lora_rank > 0): the trained params are the adapters
(model/lora.py), so the optimizer state is adapter-sized; the frozen base is in the task state, an
argument of the step (sharded like the params, not a constant of the jitted program), as a `Frozen`
node, which checkpoints leave out and every restore reads again from `checkpoint.init_from`, at the
step the run started from (task_state[BASE_STEP], checkpointed: a base run that trains on, or a
newer step, changes nothing for a resumed LoRA run).

The loss merges base and adapters (W + alpha / r * A @ B) and calls the inner task's loss on the
full weights. With model.lora_base_bits=8 the base's layer weights are held in int8 with a scale
per output channel (model/lora.py `Int8`; QLoRA-style): a quarter of a float32 base's bytes, kept
in the state, requantized from the source at every refill, and dequantized in the step before the
merge; the adapters are trained against the dequantized base, which is then the model's base (the
reference too, and what load_params merges into). Params that the inner task does not load from
checkpoint.init_from (PPO's value head) are trained in full beside the adapters. A task's frozen
reference (task_state["reference"]: DPO, GRPO, PPO) is the base itself, with no second copy.
"""

import flax.serialization
import jax
import jax.numpy as jnp

from jaxtrain.config import ConfigError
from jaxtrain.core.task import Task
from jaxtrain.model import lora as lora_lib

BASE = "lora_base"  # the task state's key of the frozen base
BASE_STEP = "lora_base_step"  # the task state's key of the base's step (checkpointed)


@jax.tree_util.register_pytree_node_class
class Frozen:
  """A subtree of the train state that checkpoints leave out (its state dict is empty): restore
  refills it from `source`, the run whose params it is (`refill`)."""

  def __init__(self, tree, source: str):
    self.tree, self.source = tree, source

  def tree_flatten(self):
    return (self.tree,), self.source

  @classmethod
  def tree_unflatten(cls, source, children):
    return cls(children[0], source)


# Saved as {}, restored as the target it is restored into (abstract until `refill`).
flax.serialization.register_serialization_state(Frozen, lambda _: {}, lambda target, _: target)


def refill(state, shardings, load):
  """`state` with every Frozen subtree read from its source: `load(source, like, step)` (builder's
  init_params) places the source's params at `step` (the checkpointed BASE_STEP) like `like`
  (shapes, dtypes, shardings)."""
  frozen = lambda x: isinstance(x, Frozen)
  if not any(frozen(x) for x in jax.tree.leaves(state, is_leaf=frozen)):
    return state
  step = int(jax.device_get(state.task_state[BASE_STEP]))

  def fill(node, sharding):
    if not isinstance(node, Frozen):
      return node
    loaded = load(node.source, lora_lib.float_like(node.tree, sharding.tree), step)
    return Frozen(lora_lib.requantize(node.tree, loaded, sharding.tree), node.source)
  return jax.tree.map(fill, state, shardings, is_leaf=frozen)


def fresh(inner, params, task_state) -> tuple[str, ...]:
  """The top-level keys of the params that `inner.init_from` keeps fresh (PPO's value head), found
  by calling it on the params' shapes with a `load` that leaves nothing."""
  loaded, _ = inner.init_from(params, task_state, lambda tree: jax.tree.map(lambda _: None, tree))
  return tuple(k for k in params if jax.tree.leaves(loaded[k]))


class Lora(Task):
  """`inner` trained through low-rank adapters of the weights that model.lora_targets names, and
  in full where its init_from keeps the params fresh (a value head)."""

  def __init__(self, inner, cfg, newest=None):
    """`newest(path) -> int`: the newest step of a run (builder's; read when the base is loaded)."""
    self.inner, m, self.newest = inner, cfg.model, newest
    self.rank, self.alpha, self.source = m.lora_rank, m.lora_alpha, cfg.checkpoint.init_from
    self.base_bits = m.lora_base_bits
    self.batch_size, self.tokens_per_batch = inner.batch_size, inner.tokens_per_batch
    self.flops_per_token = inner.flops_per_token
    params, _, task_state = jax.eval_shape(lambda: inner.init(jax.random.key(0)))
    self.fresh = fresh(inner, params, task_state)
    self.names = lora_lib.targets(self.split(params)[0], m.lora_targets)
    if not self.names:
      raise ConfigError(f"model.lora_targets={m.lora_targets!r} matches no weight of the model "
                        f"(of kinds {', '.join(lora_lib.WEIGHTS)}, e.g. 'layers/attn/q')")
    # the inner task's frozen reference (DPO, GRPO, PPO): the base stands in for it
    self.reference = "reference" in task_state

  def split(self, params) -> tuple[dict, dict]:
    """(the base's params, the fresh ones) of the inner task's params."""
    return ({k: v for k, v in params.items() if k not in self.fresh},
            {k: v for k, v in params.items() if k in self.fresh})

  def init(self, rng):
    params, extra, task_state = self.inner.init(rng)
    base, new = self.split(params)
    adapters = lora_lib.init(jax.random.fold_in(rng, 1), base, self.names, self.rank)
    rest = {k: v for k, v in task_state.items() if k != "reference"}
    base = lora_lib.quantize(base) if self.base_bits else base
    return {**adapters, **new}, extra, {**rest, BASE: Frozen(base, self.source),
                                        BASE_STEP: jnp.zeros((), jnp.int32)}

  def init_from(self, params, task_state, load):
    """The base from the checkpoint (its newest step, then kept in BASE_STEP); the adapters keep
    their init (B = 0: the base's model)."""
    step = self.newest(self.source)
    tree = task_state[BASE].tree
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    base = lora_lib.requantize(tree, load(lora_lib.float_like(tree, shardings), step), shardings)
    return params, {**task_state, BASE: Frozen(base, self.source),
                    BASE_STEP: jnp.full((), step, jnp.int32)}

  def merged(self, params, task_state):
    """(full params, the inner task's state): base + adapters, the base as the reference."""
    base = lora_lib.dequantize(task_state[BASE].tree)
    inner = {k: v for k, v in task_state.items() if k not in (BASE, BASE_STEP)}
    if self.reference:
      inner["reference"] = base
    full = lora_lib.merge(base, params, self.alpha, self.rank)
    return {**full, **{k: params[k] for k in self.fresh}}, inner

  def loss(self, params, batch, extra, task_state):
    full, inner = self.merged(params, task_state)
    return self.inner.loss(full, batch, extra, inner)

  def eval_sums(self, params, extra, task_state, batch):
    full, inner = self.merged(params, task_state)
    return self.inner.eval_sums(full, extra, inner, batch)

  def feeds_unchanged(self):
    return self.inner.feeds_unchanged()

  def make_batch(self, params, extra, task_state, batch, step):
    if self.inner.feeds_unchanged():  # the fed batch: nothing to merge
      return batch
    full, inner = self.merged(params, task_state)
    return self.inner.make_batch(full, extra, inner, batch, step)

  def batches(self, split, lo, hi):
    return self.inner.batches(split, lo, hi)

  def prepare(self, progress):
    self.inner.prepare(progress)

  def metrics(self, sums, parts):
    return self.inner.metrics(sums, parts)

  def update_extra(self, extra, sums, parts):
    return self.inner.update_extra(extra, sums, parts)

  def eval_metrics(self, sums):
    return self.inner.eval_metrics(sums)

  def constants(self):
    return self.inner.constants()

  def sizes(self):
    return self.inner.sizes()
