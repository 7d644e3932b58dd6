"""Supervised fine-tuning: next-token cross-entropy on completion (assistant) tokens only, summed
over them, of packed prompt/completion or chat examples (posttrain/data.py); metrics: loss and
completion-token accuracy, on the train batches and the held-out split. Starts from
`checkpoint.init_from` like any run."""

import jax.numpy as jnp

from jaxtrain import metrics as metrics_lib
from jaxtrain.model import ModelConfig, Transformer, active_mlp_params, param_count
from jaxtrain.posttrain import data as data_lib
from jaxtrain.core import lm
from jaxtrain.core.task import Task


class DataTask(Task):
  """What every post-training task shares: the decoder of cfg.model, the posttrain data (SFT rows or
  preference pairs) loaded once, its counts printed and logged."""
  pairs = False

  def __init__(self, cfg, workdir: str):
    self.cfg, self.workdir = cfg, workdir
    self.model = Transformer(ModelConfig.from_config(cfg.model),
                             pipeline_microbatches=cfg.train.pipeline_microbatches,
                             offload_activations=cfg.train.offload == "activations")
    t, m = cfg.train, self.model.cfg
    self.batch_size = t.batch_size
    self.tokens_per_batch = t.batch_size * t.seq_len * (2 if self.pairs else 1)
    self.flops_per_token = metrics_lib.train_flops_per_token(
        m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, t.seq_len,
        mlp_params=active_mlp_params(m))
    self._data = None

  @property
  def data(self) -> data_lib.Data:
    if self._data is None:
      self._data = data_lib.Data(self.cfg, self.workdir, self.pairs)
    return self._data

  def init(self, rng):
    variables = self.model.init(rng, jnp.zeros((1, self.cfg.train.seq_len), jnp.int32))
    return variables["params"], {k: v for k, v in variables.items() if k in lm.NON_TRAINABLE}, {}

  def prepare(self, progress):
    if progress:
      print(f"posttrain data {self.data.summary('train')}; {self.data.summary('eval')}", flush=True)

  def batches(self, split, lo, hi):
    return self.data.batches(split, lo, hi)

  def constants(self):
    c = self.data.counts
    skipped = lambda s: sum(v for k, v in c[s].items() if k in data_lib.SKIPS)
    return {"train_examples": c["train"]["examples"], "train_skipped": skipped("train"),
            "eval_examples": c["eval"]["examples"], "eval_skipped": skipped("eval")}

  def sizes(self):
    return {"params": param_count(self.model.cfg),
            "active_params": param_count(self.model.cfg, active=True)}

  def metrics(self, sums, parts):
    """Each sum per unit (a pair), 0 for a batch without one."""
    count = jnp.maximum(sums["count"], 1.0)
    return {k: v / count for k, v in sums.items() if k != "count"}

  def eval_metrics(self, sums):
    """Each sum per unit over the eval batches, as `eval_<name>`."""
    count = max(sum(float(s["count"]) for s in sums), 1.0)
    return {f"eval_{k}": sum(float(s[k]) for s in sums) / count for k in sums[0] if k != "count"}


class Sft(DataTask):
  """train.task = "sft"."""

  def _sums(self, params, extra, batch):
    logits_BLV, aux = self.model.apply({"params": params, **extra}, batch["inputs"],
                                       batch["positions"], batch["segment_ids"],
                                       mutable=["moe_stats"])
    mask_BL = batch["loss_mask"]
    ce, _, tokens = lm.cross_entropy(logits_BLV, batch["targets"], mask_BL, 0.0)
    correct = jnp.sum((jnp.argmax(logits_BLV, axis=-1) == batch["targets"]) * mask_BL)
    return {"ce": ce, "correct": correct, "count": tokens}, lm.moe_summary(aux.get("moe_stats", {}))

  def loss(self, params, batch, extra, task_state):
    del task_state
    sums, moe = self._sums(params, extra, batch)
    objective = sums["ce"]
    # the MoE router losses, token means weighted by this batch's tokens (as in core/lm.py)
    if moe:
      c = self.model.cfg
      objective = objective + sums["count"] * (c.aux_loss_weight * moe["aux_loss"] +
                                               c.router_z_weight * moe["z_loss"])
    return objective, {**sums, "moe": moe}

  def metrics(self, sums, parts):
    tokens = jnp.maximum(sums["count"], 1.0)
    return {"loss": sums["ce"] / tokens, "accuracy": sums["correct"] / tokens,
            "tokens": sums["count"]}

  def update_extra(self, extra, sums, parts):
    rate = self.model.cfg.bias_update_rate
    if not sums["moe"] or rate <= 0:
      return extra
    return lm.update_expert_bias(extra, sums["moe"]["load"] / parts, rate)

  def eval_sums(self, params, extra, task_state, batch):
    return self._sums(params, extra, batch)[0]

  def eval_metrics(self, sums):
    tokens = max(sum(float(s["count"]) for s in sums), 1.0)
    return {"eval_loss": sum(float(s["ce"]) for s in sums) / tokens,
            "eval_accuracy": sum(float(s["correct"]) for s in sums) / tokens}
