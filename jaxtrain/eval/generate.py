"""Generative task kinds: batched greedy or sampled generation with stop sequences through the
KV-cache sampler of post-training (posttrain/rollout.py), then exact match after answer extraction
(`generate`), unit tests in the sandbox with pass@k (`code`), and chat replies against a reference
(`dialogue`)."""

import functools
import os

import jax
import numpy as np

from jaxtrain import config as config_lib, parallel
from jaxtrain.eval import metrics, sandbox, score
from jaxtrain.posttrain import rollout


class Generator:
  """Generates continuations of token-id prompts with a Scorer's model and params (its rows per
  batch, its mesh): `gen(prompts, max_new_tokens, ...) -> (ids per prompt, prompts cut)`."""

  def __init__(self, scorer):
    self.model, self.params, self.extra = scorer.model, scorer.params, scorer.extra
    self.rows, self.mesh, self.mesh_rules = scorer.rows, scorer.mesh, scorer.mesh_rules
    self._rollout = jax.jit(rollout.rollout, static_argnames=rollout.STATIC_ARGNAMES)

  def _run(self, prompts_BP, lens_B, rng, **static):
    args = (prompts_BP, lens_B)
    if self.mesh is None:
      return self._rollout(self.model, self.params, *args, rng, extra=self.extra, **static)
    with parallel.activate(self.mesh, self.mesh_rules):
      args = jax.device_put(args, parallel.batch_sharding(self.mesh))
      return self._rollout(self.model, self.params, *args, rng, extra=self.extra, **static)

  def __call__(self, prompts: list[np.ndarray], max_new_tokens: int, temperature: float = 0.0,
               top_k: int = 0, seed: int = 0, stop_ids: tuple = ()) -> tuple[list, int]:
    """Each prompt's generated ids up to (without) its first stop id, and how many prompts were cut
    from the left to leave max_new_tokens slots. Batches of `rows` left-padded prompts, widths
    rounded up to 16 (few compilations); batch i draws with fold_in(key(seed), i)."""
    max_len = self.model.cfg.max_seq_len
    if not 1 <= max_new_tokens < max_len:
      raise config_lib.ConfigError(
          f"generate: max_new_tokens={max_new_tokens} must be in [1, max_seq_len={max_len})")
    room = max_len - max_new_tokens
    cut = sum(len(p) > room for p in prompts)
    prompts = [np.asarray(p, np.int32)[-room:] for p in prompts]
    out = []
    for i, start in enumerate(range(0, len(prompts), self.rows)):
      chunk = prompts[start:start + self.rows]
      width = min(room, -(-max(len(p) for p in chunk) // 16) * 16)
      prompts_BP = np.zeros((self.rows, width), np.int32)
      lens_B = np.zeros((self.rows,), np.int32)
      for b in range(self.rows):  # rows past the chunk repeat its last prompt
        p = chunk[min(b, len(chunk) - 1)]
        prompts_BP[b, width - len(p):], lens_B[b] = p, len(p)
      result = self._run(prompts_BP, lens_B, jax.random.fold_in(jax.random.key(seed), i),
                         max_new_tokens=max_new_tokens, temperature=float(temperature),
                         top_k=int(top_k), stop_tokens=tuple(int(s) for s in stop_ids))
      tokens_BN, lengths_B = score.host_values((result.tokens_BN, result.lengths_B))
      for b in range(len(chunk)):
        ids = tokens_BN[b, :lengths_B[b]]
        out.append(ids[:-1] if len(ids) and int(ids[-1]) in stop_ids else ids)
    return out, int(cut)


def cut_at_stop(text: str, until: list[str]) -> str:
  """The text before the earliest occurrence of any stop sequence."""
  ends = [text.find(s) for s in until if s and s in text]
  return text[:min(ends)] if ends else text


def _texts(gen: Generator, tokenizer, prompts, opts: dict, seed: int,
           stop_ids: tuple = ()) -> tuple[list[str], int]:
  ids, cut = gen(prompts, opts["max_new_tokens"], opts["temperature"], opts["top_k"], seed,
                 (tokenizer.eos, *stop_ids))
  return [cut_at_stop(tokenizer.decode(i), opts["until"]) for i in ids], cut


def _encode(tokenizer, text: str) -> np.ndarray:
  try:
    return np.concatenate([[tokenizer.bos], tokenizer.encode(text)]).astype(np.int32)
  except ValueError as e:  # text outside a synthetic language's symbols
    raise config_lib.ConfigError(f"cannot tokenize {text!r}: {e}") from None


def _mean_stderr(name: str, values) -> dict:
  values = np.asarray(values, np.float64)
  stderr = float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
  return {name: float(np.mean(values)), f"{name}_stderr": stderr}


def generate_task(task, gen: Generator, tokenizer, contexts: list[str], seed: int) -> dict:
  """exact_match of each doc's answer, extracted from the generation after its context."""
  texts, cut = _texts(gen, tokenizer, [_encode(tokenizer, c) for c in contexts], task.options,
                      seed)
  scores = [metrics.exact_match(t, d["answer"], task.options["answer_regex"])
            for t, d in zip(texts, task.docs)]
  return {**_mean_stderr("exact_match", scores), "docs": len(task.docs), "truncated": cut}


def program(doc: dict, completion: str) -> str:
  """The prompt, the completion, the tests, and check(entry_point) when the doc names one (the
  HumanEval layout: its tests define check(candidate))."""
  source = doc["prompt"] + completion + "\n\n" + doc["tests"] + "\n"
  return source + (f"\ncheck({doc['entry_point']})\n" if doc.get("entry_point") else "")


def code_task(task, gen: Generator, tokenizer, seed: int) -> dict:
  """pass@k (Chen et al., 2021) over n samples per doc, each run with its tests in the sandbox."""
  opts, n = task.options, task.options["n"]
  prompts = [_encode(tokenizer, d["prompt"]) for d in task.docs for _ in range(n)]
  completions, cut = _texts(gen, tokenizer, prompts, opts, seed)
  verdicts = [sandbox.run_program(program(task.docs[i // n], c), opts["timeout_s"],
                                  opts["memory_mb"]) for i, c in enumerate(completions)]
  passed = [sum(v.passed for v in verdicts[i * n:(i + 1) * n]) for i in range(len(task.docs))]
  out = {}
  for k in opts["k"]:
    out.update(_mean_stderr(f"pass@{k}", [metrics.pass_at_k(n, c, k) for c in passed]))
  return {**out, "docs": len(task.docs), "samples": len(verdicts), "truncated": cut,
          "timeouts": sum(v.status == "timeout" for v in verdicts)}


def chat_prompt(encoder, messages: list[dict]) -> tuple[np.ndarray, tuple]:
  """(the ids of a conversation up to the assistant's reply, the end-of-turn id): what the
  tokenizer's chat template (posttrain.data.Encoder) puts before an assistant turn "." appended to
  it, and the first id it puts after the "." (EOS in the default template, e.g. <|im_end|> in
  ChatML); () when it puts none."""
  pieces = encoder.chat([*messages, {"role": "assistant", "content": "."}])
  reply = list(pieces[-1][0])
  dot = (encoder.special.encode(".", add_special_tokens=False).ids if encoder.template is not None
         else [int(i) for i in encoder.tok.encode(".")])
  end = tuple(reply[len(dot):len(dot) + 1]) if reply[:len(dot)] == list(dot) else ()
  return np.asarray([i for ids, _ in pieces[:-1] for i in ids], np.int32), end


def dialogue_task(task, gen: Generator, tokenizer, seed: int) -> dict:
  """exact_match (stripped) and SQuAD token F1 of the reply, generated until the end of the turn
  or EOS (or `until`), against each doc's reference. With the header's `reward_model` (a reward
  model run of the post-training work, posttrain/reward.py) also `reward`: its score of each whole
  conversation with the reply, and `reward_reference`, with the reference in its place, and
  `reward_win_rate`, the share of docs whose reply it scores above the reference."""
  from jaxtrain.posttrain import data as post_data
  encoder = post_data.Encoder(tokenizer, gen.model.cfg.max_seq_len)
  prompts, ends = [], set()
  for i, d in enumerate(task.docs):
    try:
      prompt, end = chat_prompt(encoder, d["messages"])
      prompts.append(prompt)
      ends.update(end)
    except post_data.Skip as e:
      raise config_lib.ConfigError(
          f"{task.path}: doc {i}: the chat template cannot render its messages ({e})") from None
  replies, cut = _texts(gen, tokenizer, prompts, task.options, seed, tuple(sorted(ends)))
  em = [float(r.strip() == d["reference"].strip()) for r, d in zip(replies, task.docs)]
  f1 = [metrics.token_f1(r, d["reference"]) for r, d in zip(replies, task.docs)]
  out = {**_mean_stderr("exact_match", em), **_mean_stderr("f1", f1), "docs": len(task.docs),
         "truncated": cut}
  if task.options.get("reward_model"):
    out.update(_rewards(task, replies))
  return out


@functools.cache
def _reward_model(workdir: str):
  from jaxtrain.posttrain import reward
  if not os.path.isdir(workdir):
    raise config_lib.ConfigError(f"reward_model: no such run directory: {workdir}")
  return reward.load_reward_model(workdir)


def _rewards(task, replies) -> dict:
  """The reward model's scores of each conversation with the generated reply (stripped) and with
  the reference. An empty reply (the chat template refuses an empty turn) is not scored: counted in
  `reward_empty`, left out of the reward and the win rate."""
  from jaxtrain.posttrain import data as post_data
  rm = _reward_model(os.path.join(os.path.dirname(os.path.abspath(task.path)),
                                  task.options["reward_model"]))
  conversation = lambda d, reply: [*d["messages"], {"role": "assistant", "content": reply}]
  scored = [i for i, r in enumerate(replies) if r.strip()]
  try:
    ref = rm.chats([conversation(d, d["reference"]) for d in task.docs])
    got = (rm.chats([conversation(task.docs[i], replies[i].strip()) for i in scored]) if scored
           else None)
  except post_data.Skip as e:
    raise config_lib.ConfigError(f"{task.path}: the reward model's chat template cannot render "
                                 f"a conversation ({e})") from None
  out = {"reward_reference": float(np.mean(ref)), "reward_empty": len(replies) - len(scored)}
  if scored:
    out.update(**_mean_stderr("reward", got.tolist()),
               reward_win_rate=float(np.mean(got > ref[scored])))
  return out
