"""A converted model carries its HF tokenizer (tokenizer.json or SentencePiece tokenizer.model) and samples:
`python -m jaxtrain sample` and jaxtrain.sample continue a prompt token for token as transformers'
greedy `generate` does."""

import io
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sentencepiece  # noqa: E402

import jaxtrain  # noqa: E402
from jaxtrain import __main__ as cli, data  # noqa: E402
from jaxtrain.checkpoint import pretrained  # noqa: E402
from jaxtrain.train import workdir as workdir_lib  # noqa: E402
from tests.checkpoint.test_hf import TEXTS, bpe_tokenizer_json, hf_model  # noqa: E402

torch.set_grad_enabled(False)
from jaxtrain.train import sampling as sample_module
PROMPT, NEW = "Once upon a time", 12


def sentencepiece_model(path):
  """A SentencePiece tokenizer.model (BPE, BOS 1, EOS 2) as HF Llama-2-style models ship them."""
  proto = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=proto, vocab_size=60,
                                           model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                           hard_vocab_limit=False, minloglevel=2)
  path.write_bytes(proto.getvalue())
  return 1, 2


@pytest.fixture(scope="module", params=["tokenizer.json", "tokenizer.model"])
def converted(request, tmp_path_factory):
  """A tiny random HF Llama with a real tokenizer of that kind, converted with the CLI."""
  root = tmp_path_factory.mktemp("tok")
  make = {"tokenizer.json": bpe_tokenizer_json, "tokenizer.model": sentencepiece_model}[request.param]
  (root / "hf").mkdir()
  bos, eos = make(root / "hf" / request.param)
  model = hf_model(tie=False, vocab_size=300, bos_token_id=bos, eos_token_id=eos)
  model.save_pretrained(root / "hf", safe_serialization=True)
  assert cli.main(["convert", "--from_hf", str(root / "hf"), "--to", str(root / "wd")]) == 0
  return root, model, request.param


def hf_greedy(model, prompt_ids):
  """transformers' greedy continuation (never stopping early), after checking no step is a near-tie."""
  model.generation_config.eos_token_id = None
  ids = torch.tensor([prompt_ids])  # with an explicit mask: HF would mask a BOS that equals its pad id
  out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                       output_scores=True, return_dict_in_generate=True, pad_token_id=prompt_ids[0])
  for scores in out.scores:  # a near-tie could flip between implementations (float error ~1e-6)
    top2 = torch.topk(scores[0], 2).values
    assert top2[0] - top2[1] > 1e-3
  return out.sequences[0, len(prompt_ids):].numpy()


def test_tokenizer_is_carried_into_the_workdir(converted):
  root, _, name = converted
  wd = root / "wd"
  cfg = workdir_lib.load_config(str(wd))
  assert (cfg.data.kind, cfg.data.tokenizer) == ("text", str(wd / name))
  assert (wd / name).read_bytes() == (root / "hf" / name).read_bytes()
  tokenizer = data.make_tokenizer(cfg, str(wd))
  assert tokenizer.path == str(wd / name) and len(tokenizer.encode(PROMPT)) > 2
  ref = json.loads((wd / "tokenizer_ref.json").read_text())
  assert ref["spec"]["path"] == name and ref["fingerprint"] == tokenizer.fingerprint()  # the run dir can move
  saved, _, _ = pretrained.read_step(str(wd))
  assert saved.data.kind == "text" and saved.to_dict()["data"] == cfg.to_dict()["data"]


def test_sample_equals_transformers_greedy_generate(converted, capfd):
  root, model, _ = converted
  wd = str(root / "wd")
  tokenizer = data.make_tokenizer(workdir_lib.load_config(wd), wd)
  prompt_ids = [tokenizer.bos] + tokenizer.encode(PROMPT).tolist()
  want = hf_greedy(model, prompt_ids)
  cfg, params, extra = pretrained.read_step(wd)
  np.testing.assert_array_equal(sample_module.continue_ids(cfg.model, params, extra, prompt_ids, NEW, 0.0, 0), want)

  ended = list(want[: list(want).index(tokenizer.eos) + 1]) if tokenizer.eos in want else list(want)
  text = tokenizer.decode(ended)
  capfd.readouterr()
  assert cli.main(["sample", f"--workdir={wd}", "--prompt", PROMPT, "--max_new_tokens", str(NEW),
                   "--temperature", "0"]) == 0
  assert capfd.readouterr() == (text + "\n", "")
  assert jaxtrain.sample(wd, PROMPT, NEW, 0.0, 0) == text and text.strip()


def test_export_carries_the_tokenizer_back(converted, tmp_path):
  root, _, name = converted
  assert cli.main(["convert", "--from", str(root / "wd"), "--to_hf", str(tmp_path / "out")]) == 0
  assert (tmp_path / "out" / name).read_bytes() == (root / "hf" / name).read_bytes()


def test_without_a_tokenizer_convert_works_and_sample_says_so(tmp_path, capsys):
  hf_model(tie=False).save_pretrained(tmp_path / "hf", safe_serialization=True)
  capsys.readouterr()
  assert cli.main(["convert", "--from_hf", str(tmp_path / "hf"), "--to", str(tmp_path / "wd")]) == 0
  capsys.readouterr()
  rc = cli.main(["sample", f"--workdir={tmp_path / 'wd'}", "--prompt", PROMPT, "--max_new_tokens", "4"])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and err.count("\n") == 1 and "has no tokenizer" in err, err
  assert not os.path.exists(tmp_path / "wd" / "tokenizer_ref.json")


def test_a_tokenizer_file_that_does_not_parse_is_refused_before_writing(tmp_path, capsys):
  hf_model(tie=False).save_pretrained(tmp_path / "hf", safe_serialization=True)
  (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
  capsys.readouterr()
  rc = cli.main(["convert", "--from_hf", str(tmp_path / "hf"), "--to", str(tmp_path / "wd")])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and err.count("\n") == 1 and "tokenizer.json" in err, err
  assert sorted(os.listdir(tmp_path)) == ["hf"]
