"""jaxtrain's scoring against Hugging Face transformers: a random tiny LlamaForCausalLM,
continuation log-likelihoods computed with torch directly (lm-eval's _encode_pair after BOS), within
1e-4, and the same acc and acc_norm on a generated multiple-choice task with one few-shot
example."""

import numpy as np
import pytest

from jaxtrain.eval import evaluate, harness, score, tasks
from tests.eval.conftest import multiple_choice_docs, write_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def reference_pair(tok, bos, context, continuation):
  """lm-evaluation-harness's _encode_pair with BOS before the context, on the tokenizers library
  directly."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole = tok.encode(context + continuation, add_special_tokens=False).ids
  ctx = tok.encode(context, add_special_tokens=False).ids
  return [bos, *ctx], whole[len(ctx):]


def test_loglikelihoods_acc_and_acc_norm_equal_transformers(hf_dir, tmp_path):
  docs = multiple_choice_docs(8)
  path = write_jsonl(tmp_path / "mc.jsonl", docs)
  task = tasks.load_task(path)
  contexts = tasks.fewshot_contexts(task, 1, seed=5)
  assert all("\n\n" in c for c in contexts)

  tok = tokenizers.Tokenizer.from_file(f"{hf_dir}/tokenizer.json")
  bos = tok.token_to_id("<s>")
  model = transformers.LlamaForCausalLM.from_pretrained(hf_dir,
                                                        attn_implementation="eager").float().eval()
  want, want_greedy, pairs = [], [], []
  with torch.no_grad():
    for ctx, doc in zip(contexts, docs):
      for choice in doc["choices"]:
        c, cont = reference_pair(tok, bos, ctx, " " + choice)
        pairs.append((c, cont))
        logits = model(torch.tensor([c + cont[:-1]])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[-len(cont):]
        targets = torch.tensor(cont)
        want.append(float(logp[torch.arange(len(cont)), targets].sum()))
        want_greedy.append(bool((logits[-len(cont):].argmax(-1) == targets).all()))

  cfg, params, extra, tokenizer = harness.load_model(hf_dir)
  requests = [tasks.encode_pair(tokenizer, ctx, " " + c)
              for ctx, doc in zip(contexts, docs) for c in doc["choices"]]
  assert [(list(r.context), list(r.continuation)) for r in requests] == pairs
  got = score.Scorer(cfg, params, extra, rows=4).loglikelihood(requests)
  assert max(abs(g.logprob - w) for g, w in zip(got, want)) < 1e-4
  assert [g.is_greedy for g in got] == want_greedy and not any(g.truncated for g in got)

  lls = iter(want)
  acc, acc_norm = [], []
  for doc in docs:
    doc_lls = np.array([next(lls) for _ in doc["choices"]])
    acc.append(np.argmax(doc_lls) == doc["gold"])
    acc_norm.append(np.argmax(doc_lls / np.array([len(c) for c in doc["choices"]])) == doc["gold"])
  metrics = evaluate(hf_dir, [path], num_fewshot=1, seed=5)["mc"]
  assert (metrics["acc"], metrics["acc_norm"]) == (np.mean(acc), np.mean(acc_norm))
  assert metrics["docs"] == 8
  # lm-eval's sample stderr
  assert metrics["acc_stderr"] == pytest.approx(np.std(acc, ddof=1) / np.sqrt(8))
