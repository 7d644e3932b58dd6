"""GRPO on a tiny byte-level decoder (train.task="grpo", jaxtrain/posttrain/grpo.py): the addition task of
jaxtrain/posttrain/exact.py ("123+45=" -> the sum reversed, "861"), rewarded by exact_match.

Prompts: posttrain.train_path (JSONL rows with a prompt and, for exact_match, an answer); when it is empty,
as here, WORKDIR/posttrain_data/rl.jsonl is written with synthetic_examples problems. Real use starts from an
SFT run of the same model section (--config.checkpoint.init_from=SFT_WORKDIR, which is also the frozen
reference); from the random init, as here, the reward stays near 0: this config shows the machinery.
Rewards: posttrain.rewards="exact_match:1.0,format:0.1", or callables from Python (Grpo(cfg, workdir,
rewards=...)); posttrain.reward_model=RM_WORKDIR adds a trained reward model's score."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=258, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                 max_seq_len=32, scan_layers=False)
  c.data.update(kind="text", tokenizer="byte")  # the ids of exact.py's pre-training corpus: bytes, BOS, EOS
  c.train.update(task="grpo", steps=100, batch_size=8, seq_len=24, log_every=10, eval_every=0)
  c.posttrain.update(synthetic_examples=2000, group_size=4, max_new_tokens=8, temperature=1.0, clip_eps=0.2,
                     kl_coef=0.04, rewards="exact_match:1.0")
  c.optim.update(lr=1e-4, warmup_steps=5, schedule="constant", weight_decay=0.0)
  c.sample.update(prompt="12+34=", max_new_tokens=6, temperature=0.0, top_k=0)  # printed after training
  return c
