"""The lm-evaluation-harness adapter (jaxtrain/eval/adapter.py) against lm-eval's own Hugging Face
backend on a random tiny LlamaForCausalLM (no download): the same local multiple-choice task run by
lm_eval.simple_evaluate(model="hf") and (model="jaxtrain") gives log-likelihoods within 1e-4 and
identical acc and acc_norm; a rolling (perplexity) task the same log-likelihoods but for lm-eval's
scoring of the text's own BOS; greedy generate_until the same text; and a task YAML's few-shot
contexts (num_fewshot, description, both samplers, each few-shot pool rule) the same strings as
lm-eval builds."""

import json
import logging
import shutil

import numpy as np
import pytest

from jaxtrain.eval import score

from tests.eval.conftest import multiple_choice_docs, write_jsonl

pytest.importorskip("torch")
pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval",
                              reason="lm-eval is the `eval` extra: pip install -e '.[eval]'")
adapter = pytest.importorskip("jaxtrain.eval.adapter")  # registers the "jaxtrain" model

PPL_DOCS = [{"text": "The fox ran to the river."},
            {"text": "One day it met a bear who was fishing in the river."}]


def mc_task(path: str) -> dict:
  """A local multiple-choice task as an lm-eval task config (dataset_path: json on a local file)."""
  return {"task": "local_mc", "dataset_path": "json",
          "dataset_kwargs": {"data_files": {"test": path}},
          "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
          "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}", "target_delimiter": " ",
          "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}


def ppl_task(path: str) -> dict:
  return {"task": "local_ppl", "dataset_path": "json",
          "dataset_kwargs": {"data_files": {"test": path}},
          "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
          "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]}


def run(model: str, model_args: str, tasks: list[dict]):
  for name in ("lm_eval", "lm-eval"):
    logging.getLogger(name).setLevel(logging.ERROR)
  return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, device="cpu",
                                 batch_size=4, bootstrap_iters=0, log_samples=True,
                                 verbosity="ERROR")


def lls(result, task: str) -> list[float]:
  """Each request's log-likelihood, in document order."""
  samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
  return [float(r if isinstance(r, float) else r[0]) for s in samples for r in s["filtered_resps"]]


@pytest.fixture(scope="module")
def hf_with_specials(hf_dir, tmp_path_factory):
  """hf_dir with a tokenizer_config.json naming BOS, EOS and padding, which lm-eval's HF backend
  reads."""
  path = tmp_path_factory.mktemp("hf_lm_eval") / "model"
  shutil.copytree(hf_dir, path)
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
       "pad_token": "</s>"}))
  return str(path)


@pytest.mark.slow  # ~35 s: both backends through lm_eval.simple_evaluate
def test_jaxtrain_model_equals_the_hf_backend(hf_with_specials, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  hf_dir = hf_with_specials
  mc = write_jsonl(tmp_path / "mc.jsonl", multiple_choice_docs(12, seed=2))
  ppl = write_jsonl(tmp_path / "ppl.jsonl", PPL_DOCS)
  tasks = [mc_task(mc), ppl_task(ppl)]
  want = run("hf", f"pretrained={hf_dir},add_bos_token=True,dtype=float32", tasks)
  got = run("jaxtrain", f"path={hf_dir}", tasks)
  a, b = lls(got, "local_mc"), lls(want, "local_mc")
  assert len(a) == len(b) > 24 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
  for metric in ("acc,none", "acc_norm,none"):
    assert got["results"]["local_mc"][metric] == want["results"]["local_mc"][metric]
  # rolling: lm-eval's HF backend with add_bos_token=True encodes the text with its own BOS and
  # scores it after the prefix BOS (BOS, BOS, text); jaxtrain scores the text after one BOS
  # (tasks.py's convention).
  # The HF numbers are jaxtrain's scoring of that same sequence; the adapter's are jaxtrain's own.
  model = adapter.JaxtrainLM(hf_dir)
  bos = model.prefix_token_id
  texts = [d["text"] for d in PPL_DOCS]
  as_hf = model.scorer.loglikelihood([score.Request(np.array([bos], np.int32),
                                                    np.array([bos, *model.tok_encode(t, False)],
                                                             np.int32))
                                      for t in texts])
  assert max(abs(x.logprob - y) for x, y in zip(as_hf, lls(want, "local_ppl"))) < 1e-4
  own = model.scorer.rolling_loglikelihood([model.tok_encode(t, False) for t in texts], bos)
  assert lls(got, "local_ppl") == pytest.approx(own, abs=1e-9)


def test_greedy_generate_until_equals_the_hf_backend(hf_with_specials):
  """Greedy continuations of BOS + context, cut at `until`, as lm-eval's HF backend generates
  them."""
  from lm_eval.api.instance import Instance
  from lm_eval.models.huggingface import HFLM
  logging.getLogger("lm_eval").setLevel(logging.ERROR)
  kwargs = [{"until": ["river"], "max_gen_toks": 12, "do_sample": False},
            {"until": "\n\n", "max_gen_toks": 6}]
  reqs = [Instance("generate_until", {}, (context, kw), i)
          for i, (context, kw) in enumerate(zip(["The fox ran", "One day it", "Every day the"],
                                                kwargs * 2))]
  want = HFLM(pretrained=hf_with_specials, add_bos_token=True, dtype="float32", device="cpu",
              batch_size=2).generate_until(reqs, disable_tqdm=True)
  got = adapter.JaxtrainLM(hf_with_specials, rows=2).generate_until(reqs)
  assert got == want and any(got)


FEWSHOT_YAML = {
    # few-shot pool: the training split; drawn by seed; a description template before each doc
    "train_pool": {"training_split": "train", "num_fewshot": 2,
                   "description": "Pick the ending ({{choices|length}} choices).\n\n"},
    # fewshot_split == test_split: the doc is dropped from its own examples (n + 1 drawn)
    "own_pool": {"fewshot_split": "test", "num_fewshot": 3, "fewshot_delimiter": "\n###\n"},
    # no few-shot split: the validation split is the pool; first_n in order
    "first_n": {"validation_split": "val", "num_fewshot": 2,
                "fewshot_config": {"sampler": "first_n"}},
}


@pytest.mark.parametrize("case", list(FEWSHOT_YAML))
def test_yaml_fewshot_contexts_equal_lm_evals(tmp_path, case, monkeypatch):
  """The contexts lm-eval's ConfigurableTask builds for a local task YAML (its sampler seeded as
  simple_evaluate seeds it) are jaxtrain's for the same file, doc for doc."""
  import yaml
  from lm_eval.api.task import ConfigurableTask

  from jaxtrain.eval import tasks
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  logging.getLogger("lm_eval").setLevel(logging.ERROR)
  files = {split: write_jsonl(tmp_path / f"{split}.jsonl", multiple_choice_docs(n, seed=k))
           for k, (split, n) in enumerate([("test", 9), ("train", 7), ("val", 5)])}
  cfg = {**mc_task(files["test"]), **FEWSHOT_YAML[case]}
  cfg["dataset_kwargs"] = {"data_files": files}
  (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
  reference = ConfigurableTask(config=dict(cfg))
  reference.set_fewshot_seed(1234)
  reference.build_all_requests()
  want = {}
  for instance in reference.instances:
    want.setdefault(instance.doc_id, instance.args[0])
  got = tasks.fewshot_contexts(tasks.load_task(str(tmp_path / "t.yaml")), None, seed=1234)
  assert got == [want[i] for i in range(len(want))] and len(got) == 9
