"""BERT-base's dimensions (Devlin et al., 2019) as jaxtrain's encoder, masked-LM pre-training:
12 layers, 768 wide, 12 heads, 3072 MLP, WordPiece's 30,522 ids, 512 learned positions, 2 token
types; 110M parameters, as transformers' BertForMaskedLM (tests/core/test_mlm.py). BERT's recipe
(batch 256 x 512 tokens, AdamW 1e-4, 10K warmup steps; cosine decay where BERT decayed linearly)
on the synthetic language, so that it builds and runs anywhere; point data at a corpus with BERT's
tokenizer for the real thing (its [MASK] is id 103: train.mask_token)."""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.update(arch="encoder", positions="learned", type_vocab_size=2, vocab_size=30522,
                 d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, d_ff=3072,
                 max_seq_len=512, norm_eps=1e-12, compute_dtype="bfloat16")
  c.data.update(kind="synthetic", symbols=2000, max_symbols=200, stop_prob=1 / 64)
  c.train.update(task="mlm", steps=100_000, batch_size=256, seq_len=512, log_every=100,
                 eval_every=2000)
  c.optim.update(lr=1e-4, warmup_steps=10_000, schedule="cosine", weight_decay=0.01)
  c.mesh.update(data=-1, fsdp=1, rules="fsdp")
  c.checkpoint.every_steps = 5000
  c.sample.update(prompt="< 1 2 [MASK] 4 | 1 2 3 [MASK] >")
  return c
