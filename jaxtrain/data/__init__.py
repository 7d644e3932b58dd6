"""Host-side data: sources, tokenizers, the prepared token cache and the packing pipeline. No jax
import.

A batch is a dict of [rows, seq_len] arrays: inputs, targets, segment_ids, positions (int32) and
loss_mask (float32); synthetic batches add entropy (float32). Every iterator yields this process's
rows of consecutive global batches and has get_state()/set_state() for exact resume.
"""

from jaxtrain.data.batches import (IndexedIterator, make_iterator, make_source, make_tokenizer,
                                   prepare_corpus)
from jaxtrain.data.sources import DataError
from jaxtrain.data.synthetic import (BOS, EOS, FIRST_SYMBOL, PAD, SEP, SymbolTokenizer,
                                     SyntheticLanguage, entropy_floor)
from jaxtrain.data.text import BYTE_BOS, BYTE_EOS, BYTE_VOCAB, ByteCorpus, ByteTokenizer

__all__ = ["BOS", "BYTE_BOS", "BYTE_EOS", "BYTE_VOCAB", "ByteCorpus", "ByteTokenizer", "DataError",
           "EOS", "FIRST_SYMBOL", "IndexedIterator", "PAD", "SEP", "SymbolTokenizer",
           "SyntheticLanguage", "entropy_floor", "make_iterator", "make_source", "make_tokenizer",
           "prepare_corpus"]
