"""Logical axis names, the one vocabulary shared by every parameter and key activation.

Shape letters used in variable names and einsum strings:
  B batch, L length (query), S length (key/value), D embed, H heads, G kv heads, R heads per kv head,
  K head dim, F mlp, V vocab, E experts, C capacity, N layers.
Only `jaxtrain/parallel` maps these names to mesh axes.
"""

BATCH = "batch"
SEQ = "seq"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
EXPERT = "expert"
LAYERS = "layers"

ALL = (BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, EXPERT, LAYERS)
