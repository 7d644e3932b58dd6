"""Reward models: the decoder with a scalar head on its final hidden state at the last token of a
sequence (the completion's EOS), trained with the Bradley-Terry loss on [B, 2, L] preference pairs;
metrics: loss, accuracy (chosen scored higher), margin, on the train batches and held-out pairs. The
run is saved like any other; `load_reward_model(workdir)` turns it into a reward function for RL."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain.model import ModelConfig, Transformer, axes
from jaxtrain.posttrain import preference
from jaxtrain.posttrain.sft import DataTask

HEAD = "reward_head"  # the params entry beside the decoder's: {"w": [D], "b": []}


def scores(model, params, tokens_NL, positions_NL, segment_ids_NL):
  """The head's score of each sequence [N] at its last token
  (segment ids: 1 on tokens, 0 padding)."""
  decoder = {k: v for k, v in params.items() if k != HEAD}
  hidden_NLD = model.apply({"params": decoder}, tokens_NL, positions_NL, segment_ids_NL,
                           return_hidden=True)
  last_N = jnp.maximum(jnp.sum(segment_ids_NL > 0, axis=-1) - 1, 0)
  h_ND = jnp.take_along_axis(hidden_NLD, last_N[:, None, None], axis=1)[:, 0].astype(jnp.float32)
  return h_ND @ params[HEAD]["w"].astype(jnp.float32) + params[HEAD]["b"]


class RewardModel(DataTask):
  """train.task = "rm"."""
  pairs = True

  def init(self, rng):
    params, extra, _ = super().init(jax.random.fold_in(rng, 0))
    if extra:
      raise ValueError("train.task='rm' runs dense decoders (model.n_experts=0) for now")
    d = self.model.cfg.d_model
    w_init = nn.with_logical_partitioning(nn.initializers.normal(d ** -0.5), (axes.EMBED,))
    w = w_init(jax.random.fold_in(rng, 1), (d,), jnp.float32)
    return {**params, HEAD: {"w": w, "b": jnp.zeros((), jnp.float32)}}, extra, {}

  def init_from(self, params, task_state, load):
    """The decoder from the checkpoint (a pre-trained or SFT run), the head fresh."""
    decoder = load({k: v for k, v in params.items() if k != HEAD})
    return {**decoder, HEAD: params[HEAD]}, task_state

  def _pair_scores(self, params, batch):
    b, two, length = batch["tokens"].shape
    flat = lambda k: batch[k].reshape(b * two, length)
    return scores(self.model, params, flat("tokens"), flat("positions"),
                  flat("segment_ids")).reshape(b, two)

  def loss(self, params, batch, extra, task_state):
    p = self.cfg.posttrain
    score_BT, valid_B = self._pair_scores(params, batch), batch["valid"]
    per_pair = preference.bradley_terry(score_BT[:, 0], score_BT[:, 1], p.label_smoothing)
    center_B = p.rm_center * jnp.mean(jnp.square(score_BT), axis=-1)
    loss = jnp.sum(per_pair * valid_B)
    margin_B = score_BT[:, 0] - score_BT[:, 1]
    return loss + jnp.sum(center_B * valid_B), {
        "loss": loss, "accuracy": jnp.sum((margin_B > 0) * valid_B),
        "margin": jnp.sum(margin_B * valid_B), "count": jnp.sum(valid_B)}


class RewardFunction:
  """A trained reward model as a function: `rm(tokens_NL, lengths_N) -> scores [N]` (numpy; each
  row's first lengths[i] tokens, BOS included, are the sequence), and `rm.texts(prompts,
  completions)` through the run's tokenizer and data rules."""

  def __init__(self, cfg, params, workdir: str):
    from jaxtrain.posttrain import data as data_lib
    if HEAD not in params:
      raise config_lib.ConfigError(
          f"{workdir}: not a reward model run (its params have no {HEAD!r})")
    self.cfg, self.model = cfg, Transformer(ModelConfig.from_config(cfg.model))
    self.params = jax.device_put(params, jax.local_devices()[0])
    self.tokenizer = data_lib.make_tokenizer(cfg, workdir)
    self.encoder = data_lib.Encoder(self.tokenizer, cfg.model.max_seq_len)
    self._score = jax.jit(lambda p, t, pos, s: scores(self.model, p, t, pos, s))

  def __call__(self, tokens_NL, lengths_N) -> np.ndarray:
    tokens_NL, lengths_N = np.asarray(tokens_NL, np.int32), np.asarray(lengths_N)
    n, length = tokens_NL.shape
    segment_NL = (np.arange(length)[None] < lengths_N[:, None]).astype(np.int32)
    positions_NL = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length))
    return np.asarray(self._score(self.params, tokens_NL * segment_NL, positions_NL, segment_NL))

  def texts(self, prompts, completions) -> np.ndarray:
    return self._ids([self.encoder.example(p, c)[0] for p, c in zip(prompts, completions)])

  def chats(self, conversations) -> np.ndarray:
    """Scores of whole conversations (lists of {"role", "content"}, the last the assistant's reply)
    through the run's chat template, each cut to the model's length as training cuts it."""
    flat = lambda pieces: [i for piece, _ in pieces for i in piece][:self.encoder.max_tokens]
    return self._ids([flat(self.encoder.chat(c)) for c in conversations])

  def _ids(self, ids) -> np.ndarray:
    length = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), length), np.int32)
    for row, i in enumerate(ids):
      tokens[row, :len(i)] = i
    return self(tokens, [len(i) for i in ids])


def load_reward_model(workdir: str) -> RewardFunction:
  """The newest checkpoint of a reward-model run (train.task="rm") as a RewardFunction."""
  from jaxtrain.checkpoint import pretrained
  cfg, params, _ = pretrained.read_step(workdir)
  return RewardFunction(cfg, params, workdir)
