"""Masked-LM pre-training (BERT, Devlin et al., 2019), `train.task=mlm`: the encoder of `cfg.model`
(model.arch=encoder) predicts the chosen tokens of BERT's masking (data/masking.py) from both
sides, the cross-entropy summed over the chosen tokens only; accuracy on them is logged too.

Batches are the language model's packed rows (synthetic, bytes or a prepared text corpus), masked
on the host by (seed, split, batch, row); documents do not see each other (segment ids). On
synthetic data the eval adds `eval_mlm_bound`, a lower bound on every model's masked-token loss
(masking.copy_bound): not the causal `entropy_floor`, which predicts each token from its left only.
"""

import jax.numpy as jnp

from jaxtrain import config as config_lib, data, metrics as metrics_lib
from jaxtrain.core.lm import cross_entropy, prepare_text
from jaxtrain.core.task import Task, process_rows
from jaxtrain.data import masking
from jaxtrain.model import Encoder, ModelConfig, active_mlp_params, param_count


def mask_token(cfg) -> int:
  """The [MASK] id: train.mask_token, or model.vocab_size - 1 for -1."""
  return cfg.train.mask_token if cfg.train.mask_token >= 0 else cfg.model.vocab_size - 1


def data_vocab(cfg) -> int | None:
  """How many ids the synthetic or byte data emits (None for a text corpus: its tokenizer's)."""
  if cfg.data.kind == "synthetic":
    return data.FIRST_SYMBOL + cfg.data.symbols
  return data.BYTE_VOCAB if cfg.data.kind == "bytes" else None


class MaskedLanguageModel(Task):
  """Masked-token prediction on `cfg.data` with the encoder of `cfg.model`."""

  def __init__(self, cfg, workdir: str):
    self.cfg, self.workdir = cfg, workdir
    self.model = Encoder(ModelConfig.from_config(cfg.model))
    t, m = cfg.train, self.model.cfg
    emitted = data_vocab(cfg)
    if emitted is not None and emitted > mask_token(cfg):
      raise config_lib.ConfigError(
          f"train.mask_token={mask_token(cfg)} is an id the {cfg.data.kind} data emits (0.."
          f"{emitted - 1}): set model.vocab_size above {emitted} (the mask token is the last id)")
    self.batch_size, self.seq_len = t.batch_size, t.seq_len
    self.tokens_per_batch = t.batch_size * t.seq_len
    self.flops_per_token = metrics_lib.train_flops_per_token(
        m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, t.seq_len,
        mlp_params=active_mlp_params(m))

  def init(self, rng):
    variables = self.model.init(rng, jnp.zeros((1, self.seq_len), jnp.int32))
    return variables["params"], {}, {}

  def _sums(self, params, batch, z_loss: float):
    """(ce, z, masked tokens, correct) sums over the chosen tokens."""
    logits_BLV = self.model.apply({"params": params}, batch["inputs"], batch["positions"],
                                  batch["segment_ids"])
    ce, z, count = cross_entropy(logits_BLV, batch["targets"], batch["loss_mask"], z_loss)
    hit_BL = jnp.argmax(logits_BLV, axis=-1) == batch["targets"]
    return ce, z, count, jnp.sum(hit_BL * batch["loss_mask"])

  def loss(self, params, batch, extra, task_state):
    del extra, task_state
    ce, z, count, correct = self._sums(params, batch, self.cfg.train.z_loss)
    return ce + z, {"ce": ce, "z": z, "correct": correct, "count": count}

  def metrics(self, sums, parts):
    count = sums["count"]
    return {"loss": sums["ce"] / count, "z_loss": sums["z"] / count,
            "accuracy": sums["correct"] / count, "masked_tokens": count}

  def eval_sums(self, params, extra, task_state, batch):
    del extra, task_state
    ce, _, count, correct = self._sums(params, batch, 0.0)
    bound = (jnp.sum(batch["bound"] * batch["loss_mask"]) if "bound" in batch
             else jnp.zeros(()))
    return {"ce": ce, "count": count, "correct": correct, "bound": bound}

  def eval_metrics(self, sums):
    """Means over the masked tokens of the eval batches (fixed rows, fixed masks); synthetic data
    adds the informed predictor's loss on these very tokens, a lower bound on any model's."""
    count = max(sum(float(s["count"]) for s in sums), 1.0)
    total = lambda key: sum(float(s[key]) for s in sums)  # noqa: E731
    out = {"eval_loss": total("ce") / count, "eval_accuracy": total("correct") / count}
    if self.cfg.data.kind == "synthetic":
      out["eval_mlm_bound"] = total("bound") / count
    return out

  def batches(self, split, lo, hi):
    index, count = process_rows()
    inner = data.make_iterator(self.cfg, split, lo, hi, self.workdir, index, count)
    symbols = self.cfg.data.symbols if self.cfg.data.kind == "synthetic" else None
    return masking.MaskedBatches(inner, lo, split, self.cfg.train, self.cfg.model.vocab_size,
                                 symbols)

  def prepare(self, progress):
    prepare_text(self.cfg, self.workdir, progress)

  def sizes(self):
    n = param_count(self.model.cfg)
    return {"params": n, "active_params": n}

