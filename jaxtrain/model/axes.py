"""Logical axis names, the one vocabulary shared by every parameter and key activation.

Shape letters, the suffixes of array names (`x_BLD`) and the letters of einsum strings
("BLD,DF->BLF"), one meaning each across all of jaxtrain:
  A assignments: k * N (token, choice) pairs   N tokens
  B batch                                      P tile rows: T * tile
  C capacity slots per expert and row          Q capacity buffer slots: E * R * C
  D embed                                      R rows (sequences) taken one by one: capacity
                                                 groups, data rows
  E experts                                    S length, key/value side
  F mlp                                        T tiles of the dropless grouped matmul
  G kv heads                                   U rotary frequencies: K / 2
  H heads                                      V vocab
  I rows a gather reads                        W documents of a row (synthetic data)
  J gather entries per row (k, or 1)           X expert shards (the expert mesh axis)
  K head dim                                   Y symbols of a document's random half
                                                 (synthetic data)
  L length, query side; a row's tokens         Z layers
  M rows of a grouped matmul or gather output  k routing choices per token (top-k)
                                               1 an axis of size one
Only `jaxtrain/parallel` and `jaxtrain/collectives.py` map these names to mesh axes
(`config.RULES`).
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
# one copy per replica (optimizer buffers of DiLoCo, error feedback): the replica mesh axis
REPLICA = "replica"
# one copy per shard of the data mesh axis (error feedback with comm.axis=data)
DATA_SHARDS = "data_shards"

ALL = (BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, EXPERT, LAYERS, REPLICA,
       DATA_SHARDS)
