"""Post-training data: the completion mask, chat templates (default and a tokenizer's own), packing without
crossing examples, deterministic resumable batches, and bad rows counted and skipped."""

import json

import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.data import SymbolTokenizer, tokenizers
from jaxtrain.posttrain import data
from tests.fixtures import tiny_config


def test_prompt_completion_mask_is_one_exactly_on_completion_and_eos():
  tok = tokenizers.Bytes()
  ids, mask, cut = data.Encoder(tok, 64).example("ab", "xyz")
  assert ids.tolist() == [tok.bos, 97, 98, 120, 121, 122, tok.eos] and not cut
  assert mask.tolist() == [0, 0, 0, 1, 1, 1, 1]
  ids, mask, cut = data.Encoder(tok, 5).example("ab", "xyz")  # truncated to the context, still counted
  assert ids.tolist() == [tok.bos, 97, 98, 120, 121] and cut


def test_default_chat_template_masks_every_assistant_turn():
  tok = tokenizers.Bytes()
  messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"},
              {"role": "assistant", "content": "A!"}]
  ids, mask, _ = data.Encoder(tok, 256).example([], messages)
  text = tok.decode(ids)
  assert text == "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\nyo<|user|>\nq\n<|assistant|>\nA!"
  assert ids[0] == tok.bos and (ids == tok.eos).sum() == 2
  completion = ids[mask == 1]
  assert completion.tolist() == [*b"yo", tok.eos, *b"A!", tok.eos]


def test_a_tokenizers_own_chat_template_is_used(tmp_path):
  path = str(tmp_path / "tokenizer.json")
  tok = tokenizers.train_bpe(["hello there, how are you", "fine thanks"] * 20, 300, path)
  template = ("{{ bos_token }}{% for m in messages %}<pad>{{ m.role }}\n{{ m.content }}{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}<pad>assistant\n{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}]
  ids, mask, _ = data.Encoder(tok, 256).example([], messages)
  pad = 2  # "<pad>" is a special token: one id, not text
  assert ids[0] == tok.bos and ids[-1] == tok.eos and (ids == pad).sum() == 2
  assert tok.decode(ids[mask == 1]) == "fine" and ids[mask == 1][-1] == tok.eos
  assert tok.decode(ids[mask == 0]) == "user\nhelloassistant\n"


def write(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(r if isinstance(r, str) else json.dumps(r))
      f.write("\n")
  return str(path)


def test_bad_rows_are_counted_and_skipped(tmp_path):
  long_prompt = "< " + " ".join(["1"] * 40) + " |"
  rows = [{"prompt": "< 1 2 |", "completion": "2 1 >"}, {"prompt": "< 1 2 |"}, {"prompt": "< 1 |", "completion": " "},
          {"prompt": long_prompt, "completion": "1 >"}, {"prompt": "< x |", "completion": "1 >"}, "{not json",
          {"messages": [{"role": "user", "content": "1"}]}, {"messages": "nope"}, {"prompt": 3, "completion": "1"}]
  cfg = tiny_config(data=dict(symbols=40), posttrain=dict(train_path=write(tmp_path / "t.jsonl", rows),
                                                          eval_path=write(tmp_path / "e.jsonl", rows[:2])))
  d = data.Data(cfg, str(tmp_path), pairs=False)
  c = d.counts["train"]
  assert c["examples"] == 1 and c["bad_json"] == 1 and c["prompt_too_long"] == 1 and c["unencodable"] == 1
  assert c["missing_field"] == 3 and c["empty_completion"] == 2
  assert d.counts["eval"]["examples"] == 1 and "1 examples, 8 skipped" in d.summary("train")
  pairs = [{"prompt": "< 1 |", "chosen": "1 >", "rejected": "2 >"}, {"prompt": "< 1 |", "chosen": "1 >"},
           {"prompt": "< 1 |", "chosen": "", "rejected": "2 >"}]
  cfg.posttrain.update(train_path=write(tmp_path / "p.jsonl", pairs), eval_path="")
  d = data.Data(cfg, str(tmp_path), pairs=True)
  assert d.counts["train"]["examples"] + d.counts["eval"]["examples"] == 1
  assert d.counts["train"]["missing_field"] + d.counts["eval"]["missing_field"] == 1


def test_an_unreadable_file_is_one_config_error(tmp_path):
  cfg = tiny_config(posttrain=dict(train_path=str(tmp_path / "missing.jsonl")))
  with pytest.raises(ConfigError, match="cannot read"):
    data.Data(cfg, str(tmp_path), pairs=False)
  (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
  cfg.posttrain.train_path = str(tmp_path / "bin.jsonl")
  with pytest.raises(ConfigError, match="cannot read"):
    data.Data(cfg, str(tmp_path), pairs=False)
  (tmp_path / "empty.jsonl").write_text('{"a": 1}\n')
  cfg.posttrain.train_path = str(tmp_path / "empty.jsonl")
  with pytest.raises(ConfigError, match="no usable training rows"):
    data.Data(cfg, str(tmp_path), pairs=False)


def sft_data(tmp_path, **train):
  cfg = tiny_config(data=dict(symbols=40), train=dict(seq_len=32, batch_size=4, **train),
                    posttrain=dict(synthetic_examples=200))
  return cfg, data.Data(cfg, str(tmp_path), pairs=False)


def test_packed_rows_keep_examples_whole_and_apart(tmp_path):
  cfg, d = sft_data(tmp_path)
  batches, seen = d.batches("train", 0, 4), []
  examples = d.examples["train"]
  for _ in range(20):
    b = next(batches)
    assert b["inputs"].shape == (4, 32) and b["loss_mask"].dtype == np.float32
    for r in range(4):
      seg = b["segment_ids"][r]
      for s in range(1, seg.max() + 1):
        where = np.flatnonzero(seg == s)
        assert (np.diff(where) == 1).all() and (b["positions"][r, where] == np.arange(len(where))).all()
        ids = np.concatenate([b["inputs"][r, where], b["targets"][r, where][-1:]])
        match = [i for i, (e, _) in enumerate(examples) if len(e) == len(ids) and (e == ids).all()]
        assert match, "a packed segment is not one whole example"
        assert (b["loss_mask"][r, where] == examples[match[0]][1][1:]).all()  # the mask of the targets
        seen.append(match[0])
      assert (b["loss_mask"][r][seg == 0] == 0).all()
  # one epoch holds every example once (each row's segments are whole examples, rows take them in turn)
  per_epoch = len(examples)
  assert sorted(set(seen[:per_epoch])) == sorted(set(range(per_epoch))) or len(seen) < per_epoch


def test_batches_are_deterministic_resumable_and_split_by_process(tmp_path):
  cfg, d = sft_data(tmp_path)
  whole = d.batches("train", 0, 4)
  first = [next(whole) for _ in range(60)]  # past the first epoch
  again = d.batches("train", 0, 4)
  again.set_state({"index": 37})
  for i in range(37, 60):
    b = next(again)
    assert all((b[k] == first[i][k]).all() for k in b)
  half = data.Data(cfg, str(tmp_path), pairs=False).batches("train", 2, 4)
  b = next(half)
  assert all((b[k] == first[0][k][2:4]).all() for k in b) and half.get_state() == {"index": 1}
  other_seed = data.Data(tiny_config(data=dict(symbols=40), train=dict(seq_len=32, batch_size=4, seed=1),
                                     posttrain=dict(synthetic_examples=200)), str(tmp_path / "b"), pairs=False)
  assert not (next(other_seed.batches("train", 0, 4))["inputs"] == first[0]["inputs"]).all()


def test_eval_batches_cover_the_held_out_rows_once_then_empty_rows(tmp_path):
  _, d = sft_data(tmp_path)
  ev = d.batches("eval", 0, 4)
  tokens = sum(next(ev)["loss_mask"].sum() for _ in range(30))
  assert tokens == sum(m[1:].sum() for _, m in d.examples["eval"])
  assert next(ev)["segment_ids"].max() == 0


def test_pairs_are_b_2_l_with_completion_masks(tmp_path):
  cfg = tiny_config(data=dict(symbols=40), train=dict(seq_len=16, batch_size=4), posttrain=dict(synthetic_examples=50))
  d = data.Data(cfg, str(tmp_path), pairs=True)
  b = next(d.batches("train", 0, 4))
  assert b["tokens"].shape == (4, 2, 16) and b["valid"].tolist() == [1, 1, 1, 1]
  tok = SymbolTokenizer(40)
  row = json.loads(open(tmp_path / data.SYNTHETIC_DIR / "pairs.jsonl").readline())
  assert tok.decode(tok.encode(row["chosen"])) != tok.decode(tok.encode(row["rejected"]))
  for t in range(2):
    n = b["segment_ids"][0, t].sum()
    assert b["tokens"][0, t, 0] == tok.bos and b["tokens"][0, t, n - 1] == tok.eos
    assert b["completion_mask"][0, t, n - 1] == 1 and b["completion_mask"][0, t, 0] == 0
  assert (b["tokens"][:, 0] != b["tokens"][:, 1]).any(axis=-1).all()
  ev = d.batches("eval", 0, 4)
  assert sum(next(ev)["valid"].sum() for _ in range(5)) == d.counts["eval"]["examples"]
