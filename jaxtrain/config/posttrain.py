"""The `posttrain` section: the post-training tasks' data, losses and RL sampling (train.task
sft, rm, dpo, grpo, ppo; jaxtrain/posttrain), defaults and checks. No jax import here."""

import math

import ml_collections

from jaxtrain.config.errors import ConfigError, check_choice, check_floats

RL_AGGREGATES = ("token", "sequence")  # jaxtrain/posttrain/rl.py AGGREGATES
# grpo: group advantages / (group std + eps), or centred only (Dr. GRPO)
ADVANTAGE_SCALES = ("std", "none")
PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")  # jaxtrain/posttrain/preference.py
RANGES = {
    "posttrain.eval_fraction": (0.0, 1.0, False), "posttrain.beta": (0.0, math.inf, False),
    "posttrain.label_smoothing": (0.0, 0.5, True), "posttrain.simpo_gamma": (0.0, math.inf, True),
    "posttrain.rm_center": (0.0, math.inf, True),
    "posttrain.temperature": (0.0, math.inf, False), "posttrain.top_p": (0.0, 1.0, False),
    "posttrain.clip_eps": (0.0, math.inf, False), "posttrain.kl_coef": (0.0, math.inf, True),
    "posttrain.gamma": (0.0, 1.0, True), "posttrain.lam": (0.0, 1.0, True),
    "posttrain.value_coef": (0.0, math.inf, True), "posttrain.value_clip": (0.0, math.inf, True),
}
FIELDS = ("prompt_field", "completion_field", "messages_field", "chosen_field", "rejected_field")


def posttrain_defaults() -> ml_collections.ConfigDict:
  """Data: JSONL rows of prompt/completion, chat `messages` [{role, content}], or preference pairs
  prompt/chosen/rejected (chat lists allowed for the completions too). Tokenizer: the data section's
  (synthetic: symbols, bytes: bytes, text: data.tokenizer)."""
  p = ml_collections.ConfigDict()
  p.train_path = ""  # JSONL; "" = a synthetic reversal task written into WORKDIR/posttrain_data
  p.eval_path = ""  # JSONL; "" = eval_fraction of the train rows held out
  p.eval_fraction = 0.1
  p.prompt_field = "prompt"
  p.completion_field = "completion"
  p.messages_field = "messages"
  p.chosen_field = "chosen"
  p.rejected_field = "rejected"
  p.synthetic_examples = 2000  # rows of the synthetic task when train_path is ""
  p.loss = "dpo"  # dpo: one of PREFERENCE_LOSSES (simpo is reference-free)
  # dpo/ipo: the KL strength (ipo: 1/(2 beta) is the target margin); simpo: the reward scale
  p.beta = 0.1
  p.label_smoothing = 0.0  # dpo, rm: the assumed share of flipped labels (conservative DPO, cDPO)
  p.simpo_gamma = 0.5  # simpo: the target margin between the length-normalized rewards
  p.rm_center = 0.0  # rm: weight of mean(score^2), which keeps rewards centred near zero
  # RL (train.task grpo, ppo; jaxtrain/posttrain/grpo.py, ppo.py): train.batch_size prompts a step,
  # each sampled group_size times; train.seq_len = prompt slots + max_new_tokens. Prompts: JSONL
  # rows with prompt_field and any other fields (e.g. `answer`) passed to the reward functions; "" =
  # the addition task (jaxtrain/posttrain/exact.py) written into WORKDIR/posttrain_data/rl.jsonl.
  p.group_size = 4  # samples per prompt (grpo: >= 2, the group of its advantages; ppo: usually 1)
  p.max_new_tokens = 8  # response tokens sampled per prompt (a row stops at EOS)
  p.temperature = 1.0  # sampling temperature (> 0); the loss's log-probs use the same
  p.top_k = 0  # sampling: 0 = the whole vocabulary
  p.top_p = 1.0  # sampling: nucleus mass (1.0 = off)
  p.clip_eps = 0.2  # the clipped ratio's epsilon
  # rollout reuse (TRL, OpenRLHF): each rollout batch (train.batch_size prompts x group_size) is
  # trained on for ppo_epochs passes, each in `minibatches` shuffled minibatches, one optimizer step
  # (one train.steps) per minibatch; 1, 1: one step per rollout batch, the ratio stays 1
  p.ppo_epochs = 1
  p.minibatches = 1
  # KL to the frozen reference: grpo's loss term (k3), ppo's per-token reward penalty (k1); 0 = none
  p.kl_coef = 0.04
  p.aggregate = "token"  # one of RL_AGGREGATES: a loss unit is a response token or a sequence
  p.advantage_scale = "std"  # grpo: one of ADVANTAGE_SCALES
  p.gamma = 1.0  # ppo: discount of GAE
  p.lam = 0.95  # ppo: lambda of GAE
  p.value_coef = 0.5  # ppo: weight of the value loss
  p.value_clip = 0.2  # ppo: value clipping around the rollout's values (0 = off)
  # reward functions on decoded text, "name:weight,name:weight" (posttrain/rewards.py)
  p.rewards = "exact_match:1.0"
  # the workdir of a reward-model run (train.task=rm), its score added to rewards
  p.reward_model = ""
  p.reward_model_weight = 1.0
  return p


def validate_posttrain(cfg, shape: dict[str, int]) -> None:
  """The posttrain section and what the task needs of the others (`shape`: the mesh's). Paths are
  read, and their errors reported, by the task; an unknown train.task by builder.make_task."""
  t, p = cfg.train, cfg.posttrain
  check_choice("posttrain.loss", p.loss, PREFERENCE_LOSSES)
  for key in FIELDS:
    if not p[key]:
      raise ConfigError(f"posttrain.{key} must name a JSONL field, got ''")
  if p.synthetic_examples < 10:
    raise ConfigError(f"posttrain.synthetic_examples={p.synthetic_examples} must be >= 10")
  check_choice("posttrain.aggregate", p.aggregate, RL_AGGREGATES)
  check_choice("posttrain.advantage_scale", p.advantage_scale, ADVANTAGE_SCALES)
  if t.task in ("grpo", "ppo"):
    if p.group_size < (2 if t.task == "grpo" else 1) or p.max_new_tokens < 1 or p.top_k < 0:
      raise ConfigError(
          f"posttrain: group_size={p.group_size} (grpo: >= 2, ppo: >= 1), "
          f"max_new_tokens={p.max_new_tokens} (>= 1) and top_k={p.top_k} (>= 0) out of "
          "range")
    samples = t.batch_size * p.group_size if isinstance(t.batch_size, int) else 0
    data_ways = shape["replica"] * shape["data"] * shape["fsdp"] * shape["expert"]
    sized = all(isinstance(x, int) for x in (t.batch_size, t.microbatches))  # not "auto"
    if p.ppo_epochs < 1 or p.minibatches < 1 or sized and samples % p.minibatches or sized and (
        samples // p.minibatches) % (data_ways * t.microbatches):
      raise ConfigError(
          f"posttrain: ppo_epochs={p.ppo_epochs} (>= 1) and minibatches={p.minibatches}: the "
          f"{samples} samples of a rollout (train.batch_size x group_size) must split into "
          f"minibatches that divide into {t.microbatches} microbatch(es) over the {data_ways} "
          "data-parallel devices")
    if p.top_p < 1.0:
      raise ConfigError(
          f"posttrain.top_p={p.top_p}: {t.task}'s importance ratios need the log-probs of the "
          "distribution the tokens were drawn from, and the loss does not rebuild a nucleus; "
          "use posttrain.top_k (renormalized in the loss) or top_p=1.0")
    if t.seq_len - p.max_new_tokens < 2:
      raise ConfigError(f"train.seq_len={t.seq_len} leaves fewer than 2 prompt slots before "
                        f"posttrain.max_new_tokens={p.max_new_tokens}")
    if t.eval_every:
      raise ConfigError(
          f"train.task={t.task!r}: set train.eval_every=0 (the reward and accuracy of "
          "every step's rollouts are logged instead)")
  if t.task != "lm" and cfg.mesh.context != 1:
    raise ConfigError(f"train.task={t.task!r} with the context axis ({cfg.mesh.context}): "
                      "post-training batches are not permuted for context parallelism yet (set "
                      "--config.mesh.context=1)")
  check_floats("posttrain", p, RANGES)
