"""`python -m jaxtrain eval` end to end on a HF directory and on the workdir `convert --from_hf`
makes of it: a line per task metric, eval_results.json in the workdir, the numbers of
jaxtrain.evaluate; bad input is one line on stderr and exit status 2."""

import json
import os

import pytest

from jaxtrain import __main__ as cli
from jaxtrain.checkpoint import convert
from jaxtrain.eval import evaluate
from tests.eval.conftest import multiple_choice_docs, write_jsonl


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
  root = tmp_path_factory.mktemp("tasks")
  mc = write_jsonl(root / "mc.jsonl", multiple_choice_docs(6, seed=1))
  texts = ["The fox ran to the river.", "One day it met a bear who was fishing in the river."]
  ppl = write_jsonl(root / "wiki.jsonl", [{"text": t} for t in texts])
  return mc, ppl


def lines(text: str) -> dict:
  return {tuple(line.split()[:2]): float(line.split()[2]) for line in text.strip().splitlines()}


def test_eval_from_hf_and_from_its_converted_workdir(hf_dir, task_files, tmp_path, capsys):
  mc, ppl = task_files
  flags = ["--tasks", f"{mc},{ppl}", "--limit", "4", "--num_fewshot", "1", "--seed", "2"]
  assert cli.main(["eval", "--from_hf", hf_dir, *flags]) == 0
  printed = lines(capsys.readouterr().out)
  want = evaluate(hf_dir, [mc, ppl], limit=4, num_fewshot=1, seed=2)
  assert printed == {(task, key): pytest.approx(value, rel=1e-5)
                     for task, metrics in want.items() for key, value in metrics.items()}
  assert set(want["mc"]) >= {"acc", "acc_norm"} and want["mc"]["docs"] == 4
  assert set(want["wiki"]) >= {"word_perplexity", "byte_perplexity", "bits_per_byte"}
  assert not os.path.exists(os.path.join(hf_dir, "eval_results.json"))

  workdir = str(tmp_path / "run")
  convert.from_hf(hf_dir, workdir)
  assert cli.main(["eval", "--workdir", workdir, *flags]) == 0
  assert lines(capsys.readouterr().out) == printed
  saved = json.load(open(os.path.join(workdir, "eval_results.json")))
  assert saved["results"].keys() == want.keys()
  for task in want:
    assert saved["results"][task] == pytest.approx(want[task], rel=1e-5)
  assert (saved["num_fewshot"], saved["seed"], saved["limit"]) == (1, 2, 4)


@pytest.mark.parametrize("line, message", [
    ("{oops", "mc.jsonl:2: not JSON"),
    ('{"context": "Q:", "choices": [], "gold": 0}',
     "mc.jsonl:2: multiple_choice: 'choices' must be a non-empty"),
    ('{"context": "Q:", "choices": ["a"], "gold": 1}',
     "mc.jsonl:2: multiple_choice: 'gold' must be an integer"),
    ('{"choices": ["a"], "gold": 0}',
     "mc.jsonl:2: multiple_choice: needs a string field 'context'"),
])
def test_bad_task_file_is_one_line_and_exit_2(hf_dir, tmp_path, capsys, line, message):
  path = tmp_path / "mc.jsonl"
  path.write_text('{"context": "Q:", "choices": ["a", "b"], "gold": 0}\n' + line + "\n")
  assert cli.main(["eval", "--from_hf", hf_dir, "--tasks", str(path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and message in err


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "x.jsonl"], "one of the arguments --workdir --from_hf is required"),
    (["--from_hf", "{hf}", "--tasks", "{tmp}/missing.jsonl"], "missing.jsonl: no such task file"),
    (["--from_hf", "{hf}", "--tasks", "{tmp}/t.jsonl", "--limit", "0"], "limit=0"),
    (["--from_hf", "{hf}", "--tasks", "{tmp}/t.jsonl", "--num_fewshot", "5"],
     "needs 6 few-shot docs, has 1"),
    (["--workdir", "{tmp}/none", "--tasks", "{tmp}/t.jsonl"], "no such directory"),
])
def test_bad_flags_are_one_line_and_exit_2(hf_dir, tmp_path, capsys, argv, message):
  write_jsonl(tmp_path / "t.jsonl", [{"context": "Q:", "choices": ["a", "b"], "gold": 0}])
  argv = [a.format(hf=hf_dir, tmp=tmp_path) for a in argv]
  assert cli.main(["eval", *argv]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err


# ~18 s, most of it compiling the train step; the converted workdir above covers --workdir
@pytest.mark.slow
def test_eval_on_a_trained_byte_workdir_writes_its_results(tmp_path, capsys):
  """One training step on a byte corpus: eval reads the run's tokenizer and newest params, and
  writes the numbers jaxtrain.evaluate gives for those params."""
  import jax

  import jaxtrain
  from jaxtrain.checkpoint import pretrained
  from jaxtrain.data.tokenizers import Bytes
  from tests.fixtures import tiny_config
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the fox ran to the river and drank.\n" * 40)
  cfg = tiny_config(model={"vocab_size": 260}, data={"kind": "bytes", "path": str(corpus)},
                    train={"steps": 1}, mesh={"data": 1})
  workdir = str(tmp_path / "run")
  jaxtrain.train(cfg, workdir, devices=jax.devices()[:1], progress=False, sync_every_step=True)
  texts = ["the fox ran", "to the river, and far beyond the river bank"]
  tasks_path = write_jsonl(tmp_path / "fox.jsonl", [{"text": t} for t in texts])
  assert cli.main(["eval", "--workdir", workdir, "--tasks", tasks_path]) == 0
  saved = json.load(open(os.path.join(workdir, "eval_results.json")))["results"]["fox"]
  config, params, _ = pretrained.read_step(workdir)
  want = evaluate(params, [tasks_path], config=config, tokenizer=Bytes())["fox"]
  assert saved == pytest.approx(want, rel=1e-6) and 0 < saved["bits_per_byte"] < 20
  assert f"fox bits_per_byte {saved['bits_per_byte']:.6g}" in capsys.readouterr().out
