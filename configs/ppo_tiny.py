"""PPO on a tiny byte-level decoder (train.task="ppo", jaxtrain/posttrain/ppo.py): value head, GAE, the KL
penalty in the per-token rewards, each rollout batch trained on for 2 epochs of 2 minibatches (the ratio and
value clips bind); the addition task and rewards of grpo_tiny (see configs/grpo_tiny.py: real
use starts from an SFT run, --config.checkpoint.init_from=SFT_WORKDIR)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(vocab_size=258, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                 max_seq_len=32, scan_layers=False)
  c.data.update(kind="text", tokenizer="byte")
  c.train.update(task="ppo", steps=100, batch_size=16, seq_len=24, log_every=10, eval_every=0)
  c.posttrain.update(synthetic_examples=2000, group_size=1, max_new_tokens=8, temperature=1.0, clip_eps=0.2,
                     kl_coef=0.05, gamma=1.0, lam=0.95, value_coef=0.5, value_clip=0.2, rewards="exact_match:1.0",
                     ppo_epochs=2, minibatches=2)  # each rollout: 2 passes of 2 minibatches of 8, 4 optimizer steps
  c.optim.update(lr=1e-4, warmup_steps=5, schedule="constant", weight_decay=0.0)
  c.sample.update(prompt="12+34=", max_new_tokens=6, temperature=0.0, top_k=0)  # printed after training
  return c
