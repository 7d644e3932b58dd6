"""The task seam: a pairwise preference task written here, without touching jaxtrain/train/, trains
through `jaxtrain.train` on a 2 data x 4 fsdp mesh. Its batches are [B, 2, L] (a chosen and a rejected
row per pair) and its loss is -log sigmoid of the margin between the rows' summed log-likelihoods (the
Bradley-Terry objective of reward models, DPO without a reference)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import metrics
from jaxtrain.model import ModelConfig, Transformer
from tests.fixtures import tiny_config


class Pairs:
  """Pair i of the data: chosen = a run counting up from a random start (mod V), rejected = random
  tokens; deterministic in (seed, index), with the iterator state that resume needs."""

  def __init__(self, vocab: int, length: int, seed: int, lo: int, hi: int, split: str):
    self.vocab, self.length, self.seed, self.lo, self.hi, self.index = vocab, length, seed, lo, hi, 0
    self.split = 0 if split == "train" else 1

  def __iter__(self):
    return self

  def __next__(self):
    rows = []
    for row in range(self.lo, self.hi):
      rng = np.random.default_rng([self.seed, self.split, self.index, row])
      chosen = (rng.integers(self.vocab) + np.arange(self.length)) % self.vocab
      rows.append([chosen, rng.integers(self.vocab, size=self.length)])
    self.index += 1
    return {"tokens": np.asarray(rows, np.int32)}  # [rows, 2, L]

  def get_state(self):
    return {"index": self.index}

  def set_state(self, state):
    self.index = state["index"]


class PairwiseTask(jaxtrain.Task):

  def __init__(self, cfg):
    self.model = Transformer(ModelConfig.from_config(cfg.model))
    self.cfg, self.batch_size, self.length = cfg, cfg.train.batch_size, cfg.train.seq_len

  def init(self, rng):
    return self.model.init(rng, jnp.zeros((1, self.length), jnp.int32))["params"], {}, {}

  def loss(self, params, batch, extra, task_state):
    tokens_BTL = batch["tokens"]
    b, two, length = tokens_BTL.shape
    flat_NL = tokens_BTL.reshape(b * two, length)
    logits_NLV = self.model.apply({"params": params}, flat_NL[:, :-1])
    logp_NL = jnp.take_along_axis(jax.nn.log_softmax(logits_NLV), flat_NL[:, 1:, None], axis=-1)[..., 0]
    score_BT = jnp.sum(logp_NL, axis=-1).reshape(b, two)
    margin_B = score_BT[:, 0] - score_BT[:, 1]
    loss = -jnp.sum(jax.nn.log_sigmoid(margin_B))
    return loss, {"loss": loss, "accuracy": jnp.sum(margin_B > 0).astype(jnp.float32), "count": jnp.float32(b)}

  def batches(self, split, lo, hi):
    return Pairs(self.cfg.model.vocab_size, self.length, self.cfg.train.seed, lo, hi, split)


@pytest.mark.slow  # ~30 s on 2 cores: the default suite stays under 10 minutes
def test_a_pairwise_task_trains_on_a_2x4_mesh_without_touching_train(tmp_path):
  cfg = tiny_config(mesh=dict(data=2, fsdp=4), train=dict(steps=30, batch_size=16, seq_len=12, eval_every=30,
                                                          eval_batches=2, log_every=1),
                    optim=dict(lr=3e-3, warmup_steps=3))
  task = PairwiseTask(cfg)
  jaxtrain.train(cfg, str(tmp_path), task=task, progress=False, sync_every_step=True)
  rows = [r for r in metrics.read_metrics(str(tmp_path)) if "loss" in r]
  losses = [r["loss"] for r in rows]
  assert len(losses) == 30
  assert abs(losses[0] - np.log(2)) < 0.05  # an untrained model cannot tell the rows apart
  assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
  assert rows[-1]["eval_loss"] < 0.5 * losses[0] and rows[-1]["accuracy"] > 0.9
  # the parameters really are split over fsdp: [layers, embed -> fsdp, mlp]
  mesh, _, tx, _ = jaxtrain.builder.build(cfg, str(tmp_path), task=task)
  from jaxtrain import checkpoint
  ckpts = checkpoint.Checkpoints(cfg.checkpoint, str(tmp_path), read_only=True)
  state = jaxtrain.builder.restore_state(ckpts, task, tx, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  assert tuple(state.params["layers"]["mlp"]["up"].sharding.spec)[:2] == (None, "fsdp")
  assert int(state.step) == 30 and nn.unbox(state.params)["embed"].shape == (64, 32)
