"""The shipped task files (jaxtrain/eval/tasks_data, tools/make_eval_tasks.py) and
lm-evaluation-harness task YAML over local files (eval/task_yaml.py): every file loads, the
generator reproduces them byte for byte, a YAML gives the docs of the equivalent JSONL, what lies
outside the supported subset is one error line, and the shipped log-likelihood tasks run end to
end."""

import glob
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import config as config_lib
from jaxtrain.data.synthetic import SymbolTokenizer
from jaxtrain.eval import evaluate, kinds, score, tasks
from jaxtrain.model import ModelConfig, Transformer
from tests.eval.conftest import write_jsonl
from tests.fixtures import tiny_config
from tools import make_eval_tasks

DATA = tasks.SHIPPED
SHIPPED = sorted(glob.glob(os.path.join(DATA, "*")))


def test_every_shipped_file_loads_one_of_each_kind_in_tiny_symbols():
  """Every kind ships; the synthetic ones tokenize with configs/tiny.py's tokenizer, their gold
  choice is the context's copy and their label says whether the copy is there."""
  data = jaxtrain.get_config("configs/tiny.py").data
  assert (make_eval_tasks.SYMBOLS, make_eval_tasks.MAX_SYMBOLS, make_eval_tasks.STOP_PROB) == (
      data.symbols, data.max_symbols, data.stop_prob)
  loaded = {os.path.basename(p): tasks.load_task(p) for p in SHIPPED}
  assert sorted({t.kind for t in loaded.values()}) == sorted(kinds.KINDS)
  assert len(loaded) == len(kinds.KINDS) + 1  # and the YAML
  tok = SymbolTokenizer(data.symbols)
  for task in loaded.values():
    assert 3 <= len(task.docs) <= 50
    for doc in task.docs:
      if task.kind in ("code", "dialogue"):
        continue
      text = doc.get("text", doc.get("context"))
      assert "<" not in text and len(tok.encode(text)) > 1  # BOS comes from the scorer
      if task.kind == "multiple_choice":
        assert doc["choices"][doc["gold"]] == doc["context"][:-1] + ">"
        assert len(set(doc["choices"])) == 4 and all(len(tok.encode(c)) for c in doc["choices"])
      if task.kind == "classification":
        assert doc["label"] == (">" if "|" in doc["context"] else "|")
  assert loaded["synthetic_copy_choice.yaml"].docs == loaded["synthetic_copy_choice.jsonl"].docs


def test_generator_reproduces_the_shipped_files_byte_for_byte(tmp_path):
  written = make_eval_tasks.write(str(tmp_path))
  assert sorted(os.path.basename(p) for p in written) == [os.path.basename(p) for p in SHIPPED]
  for path in written:
    with open(path, "rb") as new, open(os.path.join(DATA, os.path.basename(path)), "rb") as old:
      assert new.read() == old.read(), path


QUESTIONS = [{"question": f"  is {a} more than {b}? ", "label": int(a <= b), "sum": a + b, "a": a,
              "b": b}
             for a, b in [(3, 1), (2, 5), (7, 7), (9, 4), (1, 8), (6, 2)]]
YAML_HEAD = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n"
             "    test: q.jsonl\n    train: shots.jsonl\n"
             "test_split: test\nfewshot_split: train\n")
CASES = {
    # a Jinja expression, a list literal of choices, the target a column holding an index
    "choice_list": ("output_type: multiple_choice\ndoc_to_text: \"Q: {{question.strip()}}\\nA:\"\n"
                    "doc_to_choice: [\"yes\", \"no\"]\ndoc_to_target: label\n",
                    lambda d: {"context": f"Q: {d['question'].strip()}\nA:",
                               "choices": ["yes", "no"], "gold": d["label"]}, {}),
    # choices a template rendering a list, the target a template rendering a choice's text
    "choice_template": ("output_type: multiple_choice\ndoc_to_text: question\n"
                        "doc_to_choice: \"{{['more', 'not more']}}\"\n"
                        "doc_to_target: \"{{'more' if a > b else 'not more'}}\"\n"
                        "target_delimiter: \": \"\n",
                        lambda d: {"context": d["question"], "choices": ["more", "not more"],
                                   "gold": d["label"]}, {"target_delimiter": ": "}),
    "generate": ("output_type: generate_until\ndoc_to_text: \"{{a}} + {{b}} =\"\n"
                 "doc_to_target: sum\n"
                 "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n",
                 lambda d: {"context": f"{d['a']} + {d['b']} =", "answer": str(d["sum"])},
                 {"kind": "generate", "until": ["\n"], "max_new_tokens": 16}),
    # lm-eval's rolling text is doc_to_target's
    "rolling": ("output_type: loglikelihood_rolling\ndoc_to_target: \"{{question.strip()}}\"\n",
                lambda d: {"text": d["question"].strip()}, {}),
}


def _pair(tmp_path, case: str):
  """(the task from a YAML over raw question records, the task from the equivalent JSONL)."""
  body, convert, header = CASES[case]
  write_jsonl(tmp_path / "q.jsonl", QUESTIONS[:4])
  write_jsonl(tmp_path / "shots.jsonl", QUESTIONS[4:])
  (tmp_path / "t.yaml").write_text(YAML_HEAD + body)
  write_jsonl(tmp_path / "shots_own.jsonl", [convert(d) for d in QUESTIONS[4:]])
  write_jsonl(tmp_path / "own.jsonl", [{"task": {**header, "fewshot_file": "shots_own.jsonl"}},
                                       *[convert(d) for d in QUESTIONS[:4]]])
  return tasks.load_task(str(tmp_path / "t.yaml")), tasks.load_task(str(tmp_path / "own.jsonl"))


@pytest.mark.parametrize("case", list(CASES))
def test_yaml_gives_the_docs_of_the_equivalent_jsonl(tmp_path, case):
  from_yaml, own = _pair(tmp_path, case)
  assert (from_yaml.kind, from_yaml.docs, from_yaml.fewshot_docs) == (own.kind, own.docs,
                                                                      own.fewshot_docs)
  assert (from_yaml.target_delimiter, from_yaml.fewshot_delimiter, from_yaml.options) == (
      own.target_delimiter, own.fewshot_delimiter, own.options)
  assert len(from_yaml.docs) == 4 and len(from_yaml.fewshot_docs) == 2
  if from_yaml.kind != "perplexity":
    assert tasks.fewshot_contexts(from_yaml, 2, 0) == tasks.fewshot_contexts(own, 2, 0)


def test_without_jinja2_field_templates_still_render(tmp_path, monkeypatch):
  """Without jinja2, "{{a}} + {{b}} =" is substituted field by field; an expression is refused by
  name."""
  with_jinja = _pair(tmp_path, "generate")[0]
  monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 -> ImportError
  assert tasks.load_task(str(tmp_path / "t.yaml")).docs == with_jinja.docs
  (tmp_path / "t.yaml").write_text(YAML_HEAD + CASES["choice_list"][0])
  with pytest.raises(config_lib.ConfigError, match=r":9: 'doc_to_text': .* needs jinja2") as e:
    tasks.load_task(str(tmp_path / "t.yaml"))
  assert "\n" not in str(e.value)


BAD = {
    "remote": ("dataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\ntest_split: test\n", 1,
               "'dataset_path': 'allenai/ai2_arc' is not local"),
    "function": (YAML_HEAD + "output_type: multiple_choice\n"
                 "doc_to_text: !function utils.doc_to_text\n"
                 "doc_to_choice: [a, b]\ndoc_to_target: 0\n", 9, "'doc_to_text': !function"),
    "process_docs": (YAML_HEAD + "process_docs: !function utils.process_docs\n", 8,
                     "'process_docs': !function"),
    "url": ("dataset_path: json\ndataset_kwargs:\n  data_files:\n"
            "    test: https://example.com/q.jsonl\n"
            "test_split: test\n", 2, "'dataset_kwargs': data_files must map splits to local paths"),
    "metric": (YAML_HEAD + "output_type: multiple_choice\ndoc_to_text: question\n"
               "doc_to_choice: [a, b]\ndoc_to_target: label\nmetric_list:\n  - metric: mcc\n", 12,
               "'metric_list': .* is not supported"),
    "fewshot": (YAML_HEAD + "num_fewshot: -2\n", 8, "'num_fewshot' must be an integer >= 0"),
    "sampler": (YAML_HEAD + "fewshot_config:\n  sampler: balanced\n", 8,
                "'fewshot_config': only {sampler: default | first_n} is supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unsupported_yaml_is_one_line_naming_file_line_and_key(tmp_path, case, monkeypatch):
  """A remote dataset, a !function, a URL data file, a metric jaxtrain does not compute: one
  ConfigError line, and nothing imported that could download (datasets, huggingface_hub)."""
  text, line, message = BAD[case]
  write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
  write_jsonl(tmp_path / "shots.jsonl", QUESTIONS)
  path = tmp_path / "bad.yml"
  path.write_text(text)
  for name in ("datasets", "huggingface_hub", "lm_eval"):
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(config_lib.ConfigError,
                     match=f"^{re.escape(str(path))}:{line}: {message}") as e:
    tasks.load_task(str(path))
  assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def symbol_model():
  """A random float32 model over configs/tiny.py's 200 symbols (vocab 256, max_seq_len 32)."""
  cfg = ModelConfig.from_config(tiny_config(model={"vocab_size": 256}).model)
  params = jax.tree.map(np.asarray, nn.unbox(jax.jit(Transformer(cfg).init)(
      jax.random.key(2), jnp.zeros((1, 8), jnp.int32))["params"]))
  return cfg, params, SymbolTokenizer(200)


def _direct_acc(scorer, tok, contexts, candidates, golds) -> float:
  """The mean over docs of [argmax of each candidate's log-likelihood == gold], scored one doc at a
  time."""
  hits = []
  for context, cands, gold in zip(contexts, candidates, golds):
    requests = [tasks.encode_pair(tok, context, " " + c) for c in cands]
    lls = [s.logprob for s in scorer.loglikelihood(requests)]
    hits.append(float(np.argmax(lls) == gold))
  return float(np.mean(hits))


def test_evaluate_runs_the_shipped_choice_and_classification_tasks(symbol_model):
  """limit=4 docs of the shipped multiple-choice (JSONL and YAML: the same numbers) and
  classification files through jaxtrain.evaluate, acc equal to the argmax of log-likelihoods scored
  doc by doc."""
  cfg, params, tok = symbol_model
  names = ["synthetic_copy_choice.jsonl", "synthetic_copy_choice.yaml",
           "synthetic_sep_or_eos.jsonl"]
  got = evaluate(params, [os.path.join(DATA, n) for n in names], config=cfg, tokenizer=tok, limit=4,
                 rows=4)
  choice, yaml_choice, labels = (got["synthetic_copy_choice"], got["synthetic_copy_choice_yaml"],
                                 got["synthetic_sep_or_eos"])
  assert choice == yaml_choice
  assert (choice["docs"], choice["truncated"], labels["docs"], labels["truncated"]) == (4, 0, 4, 0)
  scorer = score.Scorer(cfg, params, rows=4)
  mc = tasks.load_task(os.path.join(DATA, names[0])).docs[:4]
  assert choice["acc"] == _direct_acc(scorer, tok, [d["context"] for d in mc],
                                      [d["choices"] for d in mc],
                                      [d["gold"] for d in mc])
  cls = tasks.load_task(os.path.join(DATA, names[2]))
  assert labels["acc"] == _direct_acc(scorer, tok, [d["context"] for d in cls.docs[:4]],
                                      [cls.options["labels"]] * 4,
                                      [cls.options["labels"].index(d["label"])
                                       for d in cls.docs[:4]])
  assert 0.0 <= labels["macro_f1"] <= 1.0


def test_a_doc_the_yaml_cannot_convert_is_one_line_naming_the_data_file_and_line(tmp_path):
  """A template field a doc lacks (StrictUndefined, as lm-eval) or choices that are not a list
  literal."""
  write_jsonl(tmp_path / "q.jsonl", [QUESTIONS[0], {"question": "no numbers", "label": 0}])
  write_jsonl(tmp_path / "shots.jsonl", QUESTIONS)
  for body, line, message in [(CASES["generate"][0], 2, "template: 'a' is undefined"),
                              (CASES["choice_list"][0].replace('["yes", "no"]', '"{{question}}"'),
                               1,
                               "doc_to_choice renders ' is 3 more than 1\\? ', "
                               "not a list literal")]:
    (tmp_path / "t.yaml").write_text(YAML_HEAD + body)
    with pytest.raises(config_lib.ConfigError,
                       match=f"^{re.escape(str(tmp_path / 'q.jsonl'))}:{line}: {message} "
                                                     r"\(task .*t\.yaml\)$") as e:
      tasks.load_task(str(tmp_path / "t.yaml"))
    assert "\n" not in str(e.value)


def test_shipped_code_tasks_pass_a_solution_and_fail_a_stub():
  """Each shipped code task's tests (run as the code kind runs them, in the sandbox) accept a
  correct body and reject `return None`."""
  from jaxtrain.eval import generate, sandbox
  solutions = {"copy_document": "    s = ' '.join(map(str, half))\n    return f'< {s} | {s} >'\n",
               "is_copy": ("    a, b = text.strip('<> ').split('|')\n"
                           "    return a.split() == b.split()\n"),
               "half_of": "    return [int(x) for x in text.strip('< ').split('|')[0].split()]\n"}
  task = tasks.load_task(os.path.join(DATA, "synthetic_code.jsonl"))
  assert sorted(d["entry_point"] for d in task.docs) == sorted(solutions)
  for doc in task.docs:
    run = lambda body: sandbox.run_program(generate.program(doc, body), 5.0, 512).passed
    verdicts = (run(solutions[doc["entry_point"]]), run("    return None\n"))
    assert verdicts == (True, False), doc["entry_point"]
