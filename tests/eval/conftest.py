"""A tiny random Hugging Face Llama directory with a byte-level BPE tokenizer.json, and task files
over its texts: what the transformers comparison and the CLI tests score."""

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random float32 LlamaForCausalLM (vocab 300, 128 positions) saved with its tokenizer.json."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from tests.checkpoint.test_hf import bpe_tokenizer_json, hf_model
  path = tmp_path_factory.mktemp("hf")
  bpe_tokenizer_json(path / "tokenizer.json")
  hf_model(tie=False, seed=3, vocab_size=300, max_position_embeddings=128).save_pretrained(
      path, safe_serialization=True)
  return str(path)


def multiple_choice_docs(n: int, seed: int = 0) -> list[dict]:
  """n generated docs over the tokenizer's texts: 2-4 choices of different lengths, a random
  gold."""
  from tests.checkpoint.test_hf import TEXTS
  words = " ".join(TEXTS[:4]).replace(".", "").split()
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(n):
    context = " ".join(rng.choice(words, int(rng.integers(2, 6)))) + " then"
    lengths = rng.integers(1, 5, int(rng.integers(2, 5)))
    choices = [" ".join(rng.choice(words, int(k))) for k in lengths]
    docs.append({"context": context, "choices": choices, "gold": int(rng.integers(len(choices)))})
  return docs


def write_jsonl(path, records) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def assert_bad_task_file(tmp_path, lines, message):
  """Loading the task file of `lines` is one ConfigError line that starts `path:` then `message`."""
  from jaxtrain import config as config_lib
  from jaxtrain.eval import tasks
  path = write_jsonl(tmp_path / "bad.jsonl", lines)
  with pytest.raises(config_lib.ConfigError, match=f"^{path}:{message}") as e:
    tasks.load_task(path)
  assert "\n" not in str(e.value)
