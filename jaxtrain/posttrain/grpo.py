"""GRPO on the loop (train.task="grpo"), and what it shares with PPO (posttrain/ppo.py): `RlTask`.

Each step, `make_batch` (the loop's seam, core/task.py) turns the fed batch of prompts into a
training batch: a jitted rollout on the training mesh with the state's current params (no copy),
group_size samples per prompt; the responses decoded on the host and scored by the reward functions
(posttrain/rewards.py, names and weights from posttrain.rewards, or callables passed to the task; a
reward model's score added when posttrain.reward_model names one); their log-probs under the sampler
(logp_old) and under the frozen reference (task_state, sharded like the policy, the
checkpoint.init_from params like DPO's); GRPO's group advantages. The step's loss is then
rl.grpo_loss on the policy's log-probs. With posttrain.ppo_epochs x minibatches > 1 a rollout batch
is trained on for that many steps, one shuffled minibatch each (posttrain/reuse.py), and the ratio
moves; 1 x 1: one optimizer step per rollout batch. Rollout keys are fold_in(seed, step): resuming
mid-run samples what the uninterrupted run samples. The log-probs are those of the distribution the
tokens were drawn from (top-k renormalized, rl.sampled_logprobs; top-p is refused).

Bad input never stops a run: a reward function that raises or returns a non-finite value is counted
(by kind and by function, logged every step) and its samples get 0; a prompt longer than the prompt
slots (train.seq_len - max_new_tokens) is skipped and counted (train_skipped). Single process for
now (the responses are decoded on the host that holds them all).

From Python, with a reward function of your own:

  task = jaxtrain.posttrain.Grpo(cfg, workdir, rewards=[(my_reward, 1.0), ("exact_match", 0.5)])
  jaxtrain.train(cfg, workdir, task=task)
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain import config as config_lib, metrics as metrics_lib, parallel
from jaxtrain.model import ModelConfig, Transformer, active_mlp_params, param_count
from jaxtrain.posttrain import data as data_lib, reuse, rl, rollout as rollout_lib
from jaxtrain.posttrain.prompts import PromptBatches, Prompts
from jaxtrain.core.task import Task

RL_FILE = "rl.jsonl"  # the generated prompts, in WORKDIR/posttrain_data
_KEY_TAG = 0x5EED  # rollout keys: fold_in(fold_in(key(seed), _KEY_TAG), step)


def _rewards():
  """posttrain/rewards.py, imported when a task is built: importing it (and exact.py) with the
  package would make `python -m jaxtrain.posttrain.exact` warn that the module was already
  imported."""
  from jaxtrain.posttrain import rewards
  return rewards


def parse_rewards(spec: str) -> list[tuple[str, float]]:
  """"exact_match:1.0,format:0.5" -> [("exact_match", 1.0), ("format", 0.5)]
  (weight 1 when omitted)."""
  out = []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    name, _, weight = item.partition(":")
    try:
      out.append((name.strip(), float(weight) if weight else 1.0))
    except ValueError:
      raise config_lib.ConfigError(
          f"posttrain.rewards: {item!r} is not name or name:weight") from None
  return out


class RlTask(Task):
  """What GRPO and PPO share: the decoder, prompts, rollouts, rewards and the reference. `rewards`:
  any spec rewards.resolve takes (names, callables, (fn, weight) pairs); None: posttrain.rewards."""
  group_size: int

  def __init__(self, cfg, workdir: str, rewards=None):
    if jax.process_count() > 1:
      raise config_lib.ConfigError(f"train.task={cfg.train.task!r} runs in one process for now")
    self.cfg, self.workdir, self.p = cfg, workdir, cfg.posttrain
    self.model = Transformer(ModelConfig.from_config(cfg.model),
                             offload_activations=cfg.train.offload == "activations")
    t, m = cfg.train, self.model.cfg
    self.batch_size = t.batch_size  # prompts a step; group_size samples each
    self.group_size = self._group_size()
    self.samples = t.batch_size * self.group_size
    self.width = t.seq_len - self.p.max_new_tokens  # prompt slots
    self.schedule = reuse.Schedule(int(self.p.ppo_epochs), int(self.p.minibatches), self.samples,
                                   int(t.seed))
    self.tokens_per_batch = self.schedule.rows * t.seq_len  # a step's: one minibatch
    self.flops_per_token = metrics_lib.train_flops_per_token(
        m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, t.seq_len,
        mlp_params=active_mlp_params(m))
    spec = parse_rewards(self.p.rewards) if rewards is None else rewards
    spec = [s if _rewards()._is_pair(s) else (s, 1.0) for s in _as_list(spec)]
    if self.p.reward_model:
      from jaxtrain.posttrain.reward import load_reward_model
      rm = load_reward_model(self.p.reward_model)

      def reward_model(prompts, completions, **_):
        """The reward model's score of BOS + prompt + completion + EOS (its tokenizer; an empty
        completion too), with its params replicated on the training mesh, which the loop has in
        context."""
        if self._mesh is not None and getattr(rm.params["embed"].sharding, "mesh",
                                              None) != self._mesh:
          rm.params = jax.device_put(rm.params, NamedSharding(self._mesh, PartitionSpec()))
        tok, limit = rm.tokenizer, rm.model.cfg.max_seq_len
        ids = [([tok.bos] + [int(i)
                             for i in tok.encode(p)] + [int(i)
                                                        for i in tok.encode(c)])[:limit - 1] +
               [tok.eos] for p, c in zip(prompts, completions)]
        tokens_NL = np.zeros((len(ids), max(len(x) for x in ids)), np.int32)
        for row, x in enumerate(ids):
          tokens_NL[row, :len(x)] = x
        return rm(tokens_NL, [len(x) for x in ids])

      spec.append((reward_model, float(self.p.reward_model_weight)))
    if not spec:
      raise config_lib.ConfigError("no reward: set posttrain.rewards or posttrain.reward_model")
    self.reward_fns = spec  # (name or callable, weight) pairs, as rewards.evaluate takes them
    self.labels = _unique([label for label, _, _ in _rewards().resolve(spec)])  # evaluate's labels
    self._prompts = self._tokenizer = self._rollout = self._prepare = self._mesh = None
    self._store = reuse.Store(os.path.join(workdir, reuse.ROLLOUTS_DIR))
    self._held = None  # (rollout batch index, its arrays on the host) while it is reused

  def _group_size(self) -> int:
    return int(self.p.group_size)

  # ---- data ----

  @property
  def tokenizer(self):
    """The run's tokenizer (read when first needed: building the task touches no files)."""
    if self._tokenizer is None:
      self._tokenizer = data_lib.make_tokenizer(self.cfg, self.workdir)
    return self._tokenizer

  @property
  def prompts(self) -> Prompts:
    if self._prompts is None:
      path = self.p.train_path or self._write_addition_prompts()
      self._prompts = Prompts(path, self.tokenizer, self.width, self.p.prompt_field)
    return self._prompts

  def _write_addition_prompts(self) -> str:
    """WORKDIR/posttrain_data/rl.jsonl: synthetic_examples addition prompts {prompt, answer}
    (exact.py's SFT problems, none held out)."""
    path = os.path.join(self.workdir, data_lib.SYNTHETIC_DIR, RL_FILE)
    if not os.path.isfile(path):
      from jaxtrain.posttrain import exact
      rows = exact.make_sets(0, int(self.p.synthetic_examples), 0, 0, 0.0,
                             int(self.cfg.train.seed))["sft"]
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"prompt": r["prompt"], "answer": r["completion"]}) + "\n" for r in rows)
      os.replace(path + ".tmp", path)
    return path

  def prepare(self, progress):
    c = self.prompts.counts
    if progress:
      skipped = ", ".join(f"{k} {v}" for k, v in c.items() if k != "examples" and v) or "none"
      weights = ", ".join(f"{label} x{w:g}" for label, (_, w) in zip(self.labels, self.reward_fns))
      print(f"rl prompts: {c['examples']} (skipped: {skipped}); rewards: {weights}", flush=True)

  def batches(self, split, lo, hi):
    if split != "train":
      raise config_lib.ConfigError(
          f"train.task={self.cfg.train.task!r} has no eval split (train.eval_every=0)")
    return PromptBatches(self.prompts, self.batch_size, int(self.cfg.train.seed), lo, hi,
                         repeat=self.schedule.steps_per_rollout)

  def constants(self):
    c = self.prompts.counts
    return {"train_examples": c["examples"],
            "train_skipped": sum(v for k, v in c.items() if k != "examples"),
            "prompts_too_long": c["prompt_too_long"]}

  def sizes(self):
    return {"params": param_count(self.model.cfg),
            "active_params": param_count(self.model.cfg, active=True)}

  # ---- state ----

  def init(self, rng):
    variables = self.model.init(rng, jnp.zeros((1, self.cfg.train.seq_len), jnp.int32))
    if set(variables) != {"params"}:
      raise config_lib.ConfigError(
          f"train.task={self.cfg.train.task!r} runs dense decoders (model.n_experts=0) "
          "for now")
    params = variables["params"]
    return params, {}, ({"reference": params} if self.p.kl_coef > 0 else {})

  def init_from(self, params, task_state, load):
    """Policy and reference both from the checkpoint (normally an SFT run)."""
    return load(params), ({"reference": load(task_state["reference"])} if task_state else {})

  # ---- rollouts and the batch ----

  def decoder(self, params):
    return params

  def _sample(self, params, prompts_BP, lens_B, rng, **sampling):
    prompts_NP, lens_N = rollout_lib.repeat_groups(prompts_BP, lens_B, self.group_size)
    return rollout_lib.rollout(self.model, self.decoder(params), prompts_NP, lens_N, rng,
                               **sampling)

  def rollout_key(self, step: int):
    return jax.random.fold_in(
        jax.random.fold_in(jax.random.key(int(self.cfg.train.seed)), _KEY_TAG), step)

  def make_batch(self, params, extra, task_state, batch, step):
    """The step's batch: the rollout batch sampled now, or (rollout reuse) this step's minibatch of
    the one sampled at the rollout's first step, held on the host and in WORKDIR/rl_rollouts."""
    self._mesh = batch["prompts"].sharding.mesh
    s = self.schedule
    if s.steps_per_rollout == 1:
      return self.rollout_batch(params, task_state, batch, step)
    rollout, index = s.where(step)
    if index == 0:
      arrays = jax.device_get(self.rollout_batch(params, task_state, batch, step))
      self._held = (rollout, {k: np.asarray(v) for k, v in arrays.items()})
      self._store.save(rollout, self._held[1])
    elif self._held is None or self._held[0] != rollout:
      self._held = (rollout, self._store.load(rollout, step))
    rows, sharding = s.minibatch_rows(step), parallel.batch_sharding(self._mesh)
    # the rollout's fault counts once, on the first minibatch's row 0
    return {k: jax.device_put(
        _on_row0(v.sum() if index == 0 else 0, len(rows)) if k.startswith("faults_") else v[rows],
        sharding) for k, v in self._held[1].items()}

  def rollout_batch(self, params, task_state, batch, step):
    """All the samples of a rollout batch: rollouts, rewards, log-probs and advantages."""
    prompts_BP, lens_B = batch["prompts"], batch["prompt_lens"]
    # jitted once the mesh is known: the batch leaves laid out as a fed one
    if self._rollout is None:
      p = self.p
      self._prepare = jax.jit(self.prepare_arrays,
                              out_shardings=parallel.batch_sharding(self._mesh))
      self._rollout = jax.jit(
          functools.partial(self._sample, max_new_tokens=p.max_new_tokens,
                            temperature=float(p.temperature), top_k=int(p.top_k),
                            top_p=float(p.top_p), stop_tokens=(int(self.tokenizer.eos),),
                            pad_id=0))
    out = self._rollout(params, prompts_BP, lens_B, self.rollout_key(step))
    tokens_NT = np.asarray(jax.device_get(out.tokens_BN))
    mask_NT = np.asarray(jax.device_get(out.mask_BN))
    rows_N = np.repeat(np.asarray(jax.device_get(batch["row"])), self.group_size)
    eos = int(self.tokenizer.eos)
    completions = [self.tokenizer.decode([int(i) for i in row[m > 0] if i != eos])
                   for row, m in zip(tokens_NT, mask_NT)]
    texts = [self.prompts.texts[r] for r in rows_N]
    fields = {k: [self.prompts.fields[r][k] for r in rows_N] for k in self.prompts.field_names}
    reward_N, counts = _rewards().evaluate(self.reward_fns, texts, completions, **fields)
    host = {"reward": np.asarray(reward_N, np.float32)}
    if "answer" in fields:  # the task's accuracy: exact answers
      host["correct"] = np.asarray(
          _rewards().exact_match(texts, completions, answer=fields["answer"]), np.float32)
    for kind in _rewards().FAULTS:  # counts on row 0: summed over rows by the loss
      host[f"faults_{kind}"] = _on_row0(counts["total"][kind], len(reward_N))
    for label in self.labels:
      host[f"faults_by_{label}"] = _on_row0(sum(counts.get(label, {}).values()), len(reward_N))
    host = {k: jax.device_put(v, parallel.batch_sharding(self._mesh)) for k, v in host.items()}
    arrays = self._prepare(params, task_state, prompts_BP, lens_B, out, host["reward"])
    return {**arrays, **host}

  def prepare_arrays(self, params, task_state, prompts_BP, lens_B, out, reward_N):
    """The jitted part of the batch after the rewards: inputs, masks, log-probs, advantages."""
    prompts_NP, lens_N = rollout_lib.repeat_groups(prompts_BP, lens_B, self.group_size)
    tokens_NL, positions_NL, segment_NL = rollout_lib.sequence_inputs(prompts_NP, lens_N,
                                                                      out.tokens_BN)
    arrays = {"tokens": tokens_NL, "positions": positions_NL, "segment_ids": segment_NL,
              "mask": out.mask_BN, "logp_old": out.logp_BN}
    if task_state:
      logits_NTV = self.response_logits(self.decoder(task_state["reference"]), arrays)
      arrays["logp_ref"] = jax.lax.stop_gradient(self.token_logps(logits_NTV, arrays))
    else:
      arrays["logp_ref"] = out.logp_BN
    return {**arrays, **self.advantages(params, arrays, reward_N)}

  def advantages(self, params, arrays, reward_N) -> dict:
    raise NotImplementedError

  # ---- the policy's view of a batch ----

  def response_logits(self, decoder, batch, return_hidden=False):
    """Logits [N, T, V] predicting the response tokens
    (and the hidden states [N, T, D] before them)."""
    out = self.model.apply({"params": decoder}, batch["tokens"][:, :-1], batch["positions"][:, :-1],
                           batch["segment_ids"][:, :-1], return_hidden=return_hidden)
    t = batch["mask"].shape[1]
    if not return_hidden:
      return out[:, self.width - 1:]
    hidden_NTD = out[:, self.width - 1:]
    c = self.model.cfg
    w_DV = decoder["embed"].T if c.tie_embeddings else decoder["unembed"]
    logits_NTV = jnp.einsum("NTD,DV->NTV", hidden_NTD, w_DV.astype(c.compute_dtype),
                            preferred_element_type=jnp.float32)
    assert logits_NTV.shape[1] == t
    return logits_NTV, hidden_NTD

  def scaled(self, logits_NTV):
    return logits_NTV.astype(jnp.float32) / self.p.temperature

  def token_logps(self, logits_NTV, batch):
    """The response tokens' log-probs under the sampling distribution (top-k renormalized)."""
    return rl.sampled_logprobs(self.scaled(logits_NTV), batch["tokens"][:, self.width:],
                               int(self.p.top_k)) * batch["mask"]

  def host_sums(self, batch) -> dict:
    """The rollouts' statistics as sums over samples (metrics divides by "samples")."""
    reward_N = batch["reward"]
    sums = {"samples": jnp.sum(jnp.ones_like(reward_N)), "reward": jnp.sum(reward_N),
            "reward_sq": jnp.sum(jnp.square(reward_N)), "length": jnp.sum(batch["mask"])}
    if "correct" in batch:
      sums["correct"] = jnp.sum(batch["correct"])
    for k in batch:
      if k.startswith("faults_"):
        sums[k] = jnp.sum(batch[k])
    return sums

  def metrics(self, sums, parts):
    count, n = jnp.maximum(sums["count"], 1.0), jnp.maximum(sums["samples"], 1.0)
    out = {"loss": sums["loss"] / count}
    for k in ("policy_loss", "value_loss", "kl", "entropy", "clip_fraction", "value_clip_fraction",
              "ratio_mean", "approx_kl"):
      if k in sums:
        out[k] = sums[k] / count
    mean = sums["reward"] / n
    out.update(reward_mean=mean,
               reward_std=jnp.sqrt(jnp.maximum(sums["reward_sq"] / n - jnp.square(mean),
                                               0.0)), response_length=sums["length"] / n)
    if "correct" in sums:
      out["accuracy"] = sums["correct"] / n
    out.update({"reward_faults_" + k.removeprefix("faults_").removeprefix("by_"): v
                for k, v in sums.items() if k.startswith("faults_")})
    return out


def _on_row0(value, n: int) -> np.ndarray:
  x = np.zeros(n, np.float32)
  x[0] = value
  return x


def _as_list(spec) -> list:
  """A rewards spec as a list of items (names, callables, pairs); a dict as its
  (name, weight) items."""
  if hasattr(spec, "items"):
    return list(spec.items())
  if isinstance(spec, (list, tuple)) and not _rewards()._is_pair(spec):
    return list(spec)
  return [spec]


def _unique(labels):
  """evaluate's labels: a repeated one gets `_i` (its index)."""
  seen, out = set(), []
  for i, label in enumerate(labels):
    label = label if label not in seen else f"{label}_{i}"
    seen.add(label)
    out.append(label)
  return out


class Grpo(RlTask):
  """train.task = "grpo": group advantages,
  the clipped surrogate and beta * k3 KL to the reference."""

  def advantages(self, params, arrays, reward_N):
    reward_BG = reward_N.reshape(-1, self.group_size)
    return {"advantages": rl.group_advantages(reward_BG, self.p.advantage_scale).reshape(-1)}

  def loss(self, params, batch, extra, task_state):
    del extra, task_state
    p = self.p
    logits_NTV = self.response_logits(params, batch)
    logp_NT = self.token_logps(logits_NTV, batch)
    objective, sums = rl.grpo_loss(logp_NT, batch["logp_old"], batch["logp_ref"],
                                   batch["advantages"], batch["mask"], p.clip_eps, p.kl_coef,
                                   how=p.aggregate, entropy_BT=rl.entropy(self.scaled(logits_NTV)))
    return objective, {**sums, **self.host_sums(batch)}
