"""Language-model pre-training, the first task: next-token cross-entropy (+ z-loss) summed over
tokens, the MoE router losses, and the expert-bias update of auxiliary-loss-free balancing."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxtrain import collectives, data, metrics as metrics_lib
from jaxtrain.kernels.cross_entropy import ops as ce_ops
from jaxtrain.model import (ModelConfig, Transformer, active_mlp_params, axes, context,
                            param_count)
from jaxtrain.core.task import Task, process_rows

# model collections kept in the state and updated outside the optimizer
NON_TRAINABLE = ("moe_state",)


def cross_entropy(logits_BLV, targets_BL, mask_BL, z_loss: float):
  """Sums over tokens (not means, so microbatches add up exactly): (ce, z, tokens)."""
  lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  ce = jnp.sum((lse_BL - target_logit_BL) * mask_BL)
  z = z_loss * jnp.sum(jnp.square(lse_BL) * mask_BL)
  return ce, z, jnp.sum(mask_BL)


def fused_cross_entropy(model: Transformer, params, hidden_BLD, targets_BL, mask_BL, z_loss: float,
                        t):
  """cross_entropy of the model's logits, the output projection fused into the loss (`t`: the train
  section)."""
  c = model.cfg
  w, layout = (params["embed"], "VD") if c.tie_embeddings else (params["unembed"], "DV")
  w = nn.unbox(w).astype(c.compute_dtype)
  b, l, d = hidden_BLD.shape
  return ce_ops.cross_entropy(hidden_BLD.reshape(b * l, d), w, targets_BL.reshape(-1),
                              mask_BL.reshape(-1), z_loss, w_layout=layout, impl=t.cross_entropy,
                              token_chunk=t.ce_token_chunk, vocab_chunk=t.ce_vocab_chunk,
                              tokens=collectives.logical_spec((axes.BATCH, axes.SEQ)))


def moe_summary(moe_stats: dict) -> dict:
  """Per-layer MoE statistics of every scan (sown by the model) -> means over MoE layers, and the
  [moe layers, experts] load. Empty for a dense model."""
  per_layer = [stats for name in sorted(moe_stats) for stats in moe_stats[name]]
  if not per_layer:
    return {}
  joined = {
      k: jnp.concatenate([s[k].reshape(-1, *s[k].shape[1:]) for s in per_layer])
      for k in per_layer[0]
  }
  out = {k: jnp.mean(v) for k, v in joined.items() if k != "load"}
  out["load"] = joined["load"]
  return out


def update_expert_bias(extra: dict, load_ZE, rate: float) -> dict:
  """Auxiliary-loss-free balancing (DeepSeek-V3): each expert's selection bias moves by `rate`
  towards balance, up when the expert got less than its share of tokens, down when more."""
  leaves, treedef = jax.tree.flatten(extra["moe_state"])
  if len(leaves) != 1 or leaves[0].shape != load_ZE.shape:
    raise ValueError(
        f"expert biases {[x.shape for x in leaves]} do not match the load {load_ZE.shape}")
  bias = leaves[0] + rate * jnp.sign(1.0 / load_ZE.shape[-1] - load_ZE)
  return {**extra, "moe_state": jax.tree.unflatten(treedef, [bias])}


def prepare_text(cfg, workdir: str, progress: bool) -> None:
  """kind "text": tokenizer and token caches, made once by process 0; the others wait, then reuse
  them."""
  if cfg.data.kind != "text":
    return
  index, count = process_rows()
  if index == 0:
    data.prepare_corpus(cfg, workdir, progress)
  if count > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("jaxtrain_prepare")
    if index != 0:
      data.prepare_corpus(cfg, workdir, progress=False)  # finds and reuses the caches


class LanguageModel(Task):
  """Next-token prediction on `cfg.data` with the decoder of `cfg.model`; batches [B, L] from
  jaxtrain.data (synthetic, bytes, or a prepared text corpus in `workdir`)."""

  def __init__(self, cfg, workdir: str):
    self.cfg, self.workdir = cfg, workdir
    self.model = Transformer(ModelConfig.from_config(cfg.model),
                             pipeline_microbatches=cfg.train.pipeline_microbatches,
                             offload_activations=cfg.train.offload == "activations")
    t, m = cfg.train, self.model.cfg
    self.batch_size, self.seq_len, self.z_loss = t.batch_size, t.seq_len, t.z_loss
    self.tokens_per_batch = t.batch_size * t.seq_len
    self.flops_per_token = metrics_lib.train_flops_per_token(
        m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, t.seq_len,
        mlp_params=active_mlp_params(m))

  def init(self, rng):
    variables = self.model.init(rng, jnp.zeros((1, self.seq_len), jnp.int32))
    return variables["params"], {k: v for k, v in variables.items() if k in NON_TRAINABLE}, {}

  def _cross_entropy(self, params, extra, batch, z_loss: float):
    """(ce, z, tokens) sums and the model's sown collections; train.cross_entropy picks the head:
    full logits, or the output projection fused into the loss."""
    fused = self.cfg.train.cross_entropy != "full"
    out_BLX, aux = self.model.apply({"params": params, **extra},
                                    batch["inputs"], batch["positions"], batch["segment_ids"],
                                    batch.get("indices"), return_hidden=fused,
                                    mutable=["moe_stats"])
    if fused:
      return fused_cross_entropy(self.model, params, out_BLX, batch["targets"], batch["loss_mask"],
                                 z_loss, self.cfg.train), aux
    return cross_entropy(out_BLX, batch["targets"], batch["loss_mask"], z_loss), aux

  def loss(self, params, batch, extra, task_state):
    """Summed objective (ce + z-loss + MoE router losses), with the parts as sums."""
    del task_state
    # context parallelism: rows permuted for causal load balance (else a no-op)
    batch = context.balance(batch)
    (ce, z, tokens), aux = self._cross_entropy(params, extra, batch, self.z_loss)
    moe = moe_summary(aux.get("moe_stats", {}))
    objective = ce + z
    if moe:  # router losses are token means: weighted by this batch's tokens, like the summed ce
      c = self.model.cfg
      objective = objective + tokens * (c.aux_loss_weight * moe["aux_loss"] +
                                        c.router_z_weight * moe["z_loss"])
    return objective, {"ce": ce, "z": z, "count": tokens, "moe": moe}

  def metrics(self, sums, parts):
    tokens = sums["count"]
    out = {"loss": sums["ce"] / tokens, "z_loss": sums["z"] / tokens, "tokens": tokens}
    moe = jax.tree.map(lambda v: v / parts, sums["moe"])  # means of the parts' means
    if moe:
      load_ZE = moe["load"]
      out.update({
          "moe_aux_loss": moe["aux_loss"], "moe_z_loss": moe["z_loss"],
          "moe_dropped": moe["dropped"], "moe_router_entropy": moe["entropy"],
          "moe_load": jnp.mean(load_ZE, axis=0),
          "moe_imbalance": jnp.mean(jnp.max(load_ZE, axis=-1)) * load_ZE.shape[-1]
      })
    return out

  def update_extra(self, extra, sums, parts):
    rate = self.model.cfg.bias_update_rate
    if not sums["moe"] or rate <= 0:
      return extra
    return update_expert_bias(extra, sums["moe"]["load"] / parts, rate)

  def eval_sums(self, params, extra, task_state, batch):
    """Summed cross-entropy, token count and (synthetic data) summed exact entropy of one batch."""
    del task_state
    # context parallelism: rows permuted for causal load balance (else a no-op)
    batch = context.balance(batch)
    (ce, _, tokens), _ = self._cross_entropy(params, extra, batch, 0.0)
    entropy = (jnp.sum(batch["entropy"] * batch["loss_mask"]) if "entropy" in batch
               else jnp.zeros(()))
    return {"ce": ce, "tokens": tokens, "entropy": entropy}

  def eval_metrics(self, sums):
    """Token-mean loss over the eval batches (a fixed held-out set); synthetic data adds the exact
    entropy of these very tokens."""
    tokens = max(sum(float(s["tokens"]) for s in sums), 1.0)
    out = {"eval_loss": sum(float(s["ce"]) for s in sums) / tokens}
    if self.cfg.data.kind == "synthetic":
      out["eval_entropy_floor"] = sum(float(s["entropy"]) for s in sums) / tokens
    return out

  def batches(self, split, lo, hi):
    index, count = process_rows()
    return data.make_iterator(self.cfg, split, lo, hi, self.workdir, index, count)

  def prepare(self, progress):
    prepare_text(self.cfg, self.workdir, progress)

  def constants(self):
    if self.cfg.data.kind != "synthetic":
      return {}
    return {"entropy_floor": data.make_source(self.cfg, "train").expected_entropy_floor()}

  def sizes(self):
    return {
        "params": param_count(self.model.cfg),
        "active_params": param_count(self.model.cfg, active=True)
    }
