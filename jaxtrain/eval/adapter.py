"""lm-evaluation-harness's model interface backed by jaxtrain's scoring (the `eval` extra:
`pip install -e ".[eval]"`). Importing this module registers the model as "jaxtrain":

  import jaxtrain.eval.adapter  # registers "jaxtrain"
  import lm_eval
  lm_eval.simple_evaluate(model="jaxtrain", model_args="path=RUN_OR_HF_DIR", tasks=[...])

`path` is a training or converted workdir (its newest step) or a HF Llama / Mixtral directory, read
as `jaxtrain.evaluate` reads it; `rows` and `seq_len` size the packed batches (score.Scorer), where
the requests of one context share one document (`share_contexts`, default true).
Requests are tokenized as lm-eval's Hugging Face backend does with add_bos_token=True: the context
after the tokenizer's BOS (an empty context is BOS alone), its trailing whitespace moved to the
continuation (TemplateLM._encode_pair). loglikelihood_rolling scores disjoint windows of seq_len
tokens, each after the last token of the one before (score.rolling_requests): the text after one
BOS, where the HF backend with add_bos_token=True scores the text's own BOS too (BOS, BOS, text).
generate_until runs the KV-cache sampler (generate.Generator) on BOS + context: greedy unless
do_sample, up to max_gen_toks (default 256, at most max_seq_len - 1) or EOS, cut at the first
`until` string.
"""

# the built-in models' lazy entries: registered after ours, lm-eval would never load them
import lm_eval.models  # noqa: F401
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from jaxtrain.eval import generate, harness, score

MAX_GEN_TOKS = 256  # lm-eval's default max_gen_toks


@register_model("jaxtrain")
class JaxtrainLM(TemplateLM):
  """An lm_eval model scored by jaxtrain.eval.score.Scorer (packed, one compiled program)."""

  def __init__(self, path: str, rows: int = 8, seq_len: int | None = None,
               share_contexts: bool = True, batch_size=None, max_batch_size=None, device=None,
               **unused):
    """`batch_size`, `max_batch_size` and `device` are lm-eval's generic arguments: batches are
    `rows` packed rows on jax's default device whatever they say. `share_contexts=False`: each
    request in its own document, its context computed again for each choice (score.Scorer)."""
    super().__init__()
    if unused:
      raise ValueError(f"jaxtrain lm_eval model: unknown model_args {sorted(unused)}; it takes "
                       "path, rows, seq_len, share_contexts")
    model_cfg, params, extra, self.tokenizer = harness.load_model(path)
    self.scorer = score.Scorer(model_cfg, params, extra, int(rows),
                               int(seq_len) if seq_len else None,
                               share_contexts=bool(share_contexts))
    self.path, self._generator = path, None

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos

  @property
  def prefix_token_id(self) -> int:
    return self.tokenizer.bos

  @property
  def max_length(self) -> int:
    return self.scorer.seq_len

  @property
  def tokenizer_name(self) -> str:
    return f"jaxtrain:{self.path}"

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The ids of `string` after BOS (without it when add_special_tokens is False)."""
    ids = [int(i) for i in self.tokenizer.encode(string)]
    return ids if add_special_tokens is False else [self.tokenizer.bos, *ids]

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    scores = self.scorer.loglikelihood([score.Request(np.asarray(ctx, np.int32),
                                                      np.asarray(cont, np.int32))
                                        for _, ctx, cont in requests])
    out = []
    for (pair, _, _), s in zip(requests, scores):
      answer = (s.logprob, s.is_greedy)
      self.cache_hook.add_partial("loglikelihood", pair, answer)
      out.append(answer)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    texts = [req.args[0] for req in requests]
    lls = self.scorer.rolling_loglikelihood([self.tok_encode(t, add_special_tokens=False)
                                             for t in texts], self.tokenizer.bos)
    for text, ll in zip(texts, lls):
      self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
    return lls

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's (context, gen_kwargs) continued; requests with the same gen_kwargs batched."""
    if self._generator is None:
      self._generator = generate.Generator(self.scorer)
    groups = {}
    for i, req in enumerate(requests):
      context, kwargs = req.args
      groups.setdefault(repr(sorted(kwargs.items())), (kwargs, []))[1].append((i, context))
    out = [None] * len(requests)
    for kwargs, items in groups.values():
      until = kwargs.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = min(int(kwargs.get("max_gen_toks", MAX_GEN_TOKS)), self.scorer.seq_len - 1)
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
      prompts = [np.asarray(self.tok_encode(context), np.int32) for _, context in items]
      ids, _ = self._generator(prompts, max_new, temperature, stop_ids=(self.tokenizer.eos,))
      for (i, context), gen_ids in zip(items, ids):
        text = generate.cut_at_stop(self.tokenizer.decode(gen_ids), until)
        self.cache_hook.add_partial("generate_until", (context, kwargs), text)
        out[i] = text
    return out
