"""Post-training data, host side (numpy): JSONL rows -> token ids with a completion mask -> packed
[B, L] batches (SFT) or [B, 2, L] preference pairs (reward models, DPO).

Rows: `prompt` + `completion` (text: BOS + prompt + completion + EOS, no template, as TRL treats
plain text), or a chat `messages` list of {role, content} (prompt/completion/chosen/rejected may be
such lists too). Chats go through the tokenizer's own template when it has one (a `chat_template` in
the tokenizer_config.json beside a tokenizer.json, rendered with jinja2), else DEFAULT_TEMPLATE:

  <|system|>\\n{content}\\n   <|user|>\\n{content}\\n   <|assistant|>\\n{content}<EOS>

Only completion (assistant) tokens carry loss. A bad row (no such field, an empty completion, a
prompt that leaves no room in the context, text the tokenizer cannot encode, broken JSON) is counted
and skipped; a file that cannot be read is one ConfigError line.
"""

import json
import os

import numpy as np

from jaxtrain import config as config_lib, data as data_lib
from jaxtrain.data import tokenizers

# a non-assistant turn; an assistant turn: "<|assistant|>\n" content EOS
DEFAULT_TEMPLATE = "<|{role}|>\n{content}\n"
SKIPS = ("bad_json", "missing_field", "empty_completion", "prompt_too_long", "unencodable",
         "template")
SYNTHETIC_DIR = "posttrain_data"


class Skip(Exception):
  """A row that is counted and skipped; the message is one of SKIPS."""


# ---- tokenizer and chat template ----

def make_tokenizer(cfg, workdir: str):
  """The run's tokenizer (the data section's: synthetic symbols, bytes, or data.tokenizer for text);
  for text its reference is written into the workdir, so sampling finds it."""
  if cfg.data.kind != "text":
    return data_lib.make_tokenizer(cfg, workdir)
  tok = tokenizers.make_tokenizer(cfg.data, workdir)
  tokenizers.save_reference(tok, workdir)
  return tok


def chat_template(tokenizer):
  """(template text, special-token-aware tokenizers.Tokenizer) of a HF tokenizer.json whose
  tokenizer_config.json has a chat_template; None otherwise."""
  path = getattr(tokenizer, "path", "")
  config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  if not path.endswith(".json") or not os.path.isfile(config):
    return None
  with open(config) as f:
    template = json.load(f).get("chat_template")
  if isinstance(template, list):  # [{name, template}]: the default one
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  if not template:
    return None
  import tokenizers as hf_tokenizers
  return template, hf_tokenizers.Tokenizer.from_file(path)


class Encoder:
  """Text and chats -> (ids, mask) with mask 1 on completion tokens;
  `max_tokens` bounds a sequence."""

  def __init__(self, tokenizer, max_tokens: int):
    self.tok, self.max_tokens = tokenizer, max_tokens
    found = chat_template(tokenizer)
    self.template = None
    if found is not None:
      try:
        import jinja2
      except ImportError as e:
        raise config_lib.ConfigError(
            f"{tokenizer.path}: its chat template needs jinja2 (pip install jinja2)") from e
      try:
        self.template = jinja2.Environment(keep_trailing_newline=True).from_string(found[0])
      except jinja2.TemplateError as e:
        raise config_lib.ConfigError(
            f"{tokenizer.path}: its chat template does not parse: {e}") from e
      self.special = found[1]

  def _encode(self, text: str) -> list[int]:
    try:
      return [int(i) for i in self.tok.encode(text)]
    except ValueError as e:
      raise Skip("unencodable") from e

  def pieces(self, prompt, completion) -> list[tuple[list[int], int]]:
    """[(ids, is_completion)] of one example; prompt/completion are text or lists of messages."""
    if isinstance(prompt, str) and isinstance(completion, str):
      if not completion.strip():
        raise Skip("empty_completion")
      p, c = self._encode(prompt), self._encode(completion)
      p = p if p[:1] == [self.tok.bos] else [self.tok.bos] + p
      return [(p, 0), (c if c[-1:] == [self.tok.eos] else c + [self.tok.eos], 1)]
    as_list = lambda x, role: [{"role": role, "content": x}] if isinstance(x, str) else x
    return self.chat(as_list(prompt, "user") + as_list(completion, "assistant"))

  def chat(self, messages) -> list[tuple[list[int], int]]:
    if not (isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)):
      raise Skip("missing_field")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or any(not messages[i]["content"].strip() for i in turns):
      raise Skip("empty_completion")
    return self._hf_chat(messages,
                         turns) if self.template is not None else self._default_chat(messages)

  def _default_chat(self, messages):
    out, text = [([self.tok.bos], 0)], ""
    for m in messages:
      if m["role"] != "assistant":
        text += DEFAULT_TEMPLATE.format(**m)
        continue
      out.append((self._encode(text + "<|assistant|>\n"), 0))
      out.append((self._encode(m["content"]) + [self.tok.eos], 1))
      text = ""
    return out

  def _hf_chat(self, messages, turns):
    """Pieces from renders of growing prefixes: a turn's completion is what rendering it adds after
    the generation prompt (its template must render a prefix of the conversation as a prefix of the
    text). Special tokens in the rendered text are encoded as their ids; BOS/EOS come from the
    template."""
    names = {"bos_token": self.special.id_to_token(self.tok.bos),
             "eos_token": self.special.id_to_token(self.tok.eos)}
    def render(ms, gen):
      try:
        return self.template.render(messages=ms, add_generation_prompt=gen, **names)
      except Exception as e:  # the template's own raise_exception(), or anything it trips on
        raise Skip("template") from e
    out, done = [], ""
    for i in turns:
      before, full = render(messages[:i], True), render(messages[:i + 1], False)
      if not (before.startswith(done) and full.startswith(before)):
        raise Skip("template")
      out.append((self._special(before[len(done):]), 0))
      # the template ends the turn (its own end token)
      out.append((self._special(full[len(before):]), 1))
      done = full
    return out

  def _special(self, text: str) -> list[int]:
    return self.special.encode(text, add_special_tokens=False).ids if text else []

  def example(self, prompt, completion) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, completion mask, truncated) within max_tokens; Skip when no completion token fits."""
    pieces = self.pieces(prompt, completion)
    ids = [i for piece, _ in pieces for i in piece]
    mask = [flag for piece, flag in pieces for _ in piece]
    first = mask.index(1) if 1 in mask else len(mask)
    if first >= self.max_tokens:
      raise Skip("prompt_too_long")
    n = min(len(ids), self.max_tokens)
    return np.asarray(ids[:n], np.int32), np.asarray(mask[:n], np.float32), n < len(ids)


# ---- rows ----

def read_jsonl(path: str) -> tuple[list, int]:
  """(rows, broken lines) of a JSONL file; ConfigError (one line) when it cannot be read."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = [line for line in f if line.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise config_lib.ConfigError(f"posttrain: cannot read {path!r}: {e}") from e
  rows, bad = [], 0
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      row = None
    if isinstance(row, dict):
      rows.append(row)
    else:
      bad += 1
  return rows, bad


def encode_rows(rows, encoder: Encoder, p, pairs: bool):
  """Examples (SFT: (ids, mask); pairs: ((ids, mask), (ids, mask))) and counts of kept, skipped by
  reason and truncated rows."""
  examples, counts = [], dict.fromkeys(SKIPS + ("truncated",), 0)
  for row in rows:
    try:
      if pairs:
        if not all(k in row for k in (p.prompt_field, p.chosen_field, p.rejected_field)):
          raise Skip("missing_field")
        two = [encoder.example(row[p.prompt_field], row[k])
               for k in (p.chosen_field, p.rejected_field)]
        examples.append(tuple((ids, mask) for ids, mask, _ in two))
        counts["truncated"] += any(t for _, _, t in two)
      else:
        if p.messages_field in row:  # a whole conversation: every assistant turn is a completion
          if not isinstance(row[p.messages_field], list):
            raise Skip("missing_field")
          ids, mask, cut = encoder.example([], row[p.messages_field])
        elif p.prompt_field in row and p.completion_field in row:
          ids, mask, cut = encoder.example(row[p.prompt_field], row[p.completion_field])
        else:
          raise Skip("missing_field")
        examples.append((ids, mask))
        counts["truncated"] += cut
    except Skip as e:
      counts[str(e)] += 1
    except (TypeError, AttributeError):  # a field of the wrong type
      counts["missing_field"] += 1
  return examples, counts



# ---- the synthetic task (no files given) ----

def synthetic_rows(n: int, symbols: int, seed: int, pairs: bool) -> list[dict]:
  """Reversal in the synthetic language's text form: prompt "< a b c |", completion "c b a >"; pairs
  reject the reversal with one symbol changed. Deterministic in (n, symbols, seed)."""
  rng = np.random.default_rng([seed, 13])
  rows = []
  for _ in range(n):
    seq = rng.integers(symbols, size=int(rng.integers(2, 7)))
    prompt, answer = "< " + " ".join(map(str, seq)) + " |", seq[::-1].copy()
    row = {"prompt": prompt, "completion": " ".join(map(str, answer)) + " >"}
    if pairs:
      wrong = answer.copy()
      k = int(rng.integers(len(wrong)))
      wrong[k] = (wrong[k] + 1 + rng.integers(symbols - 1)) % symbols
      row = {"prompt": prompt, "chosen": row["completion"],
             "rejected": " ".join(map(str, wrong)) + " >"}
    rows.append(row)
  return rows


def write_jsonl(rows, path: str) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(tmp, path)  # a reader never sees half a file
  return path


def split_rows(cfg, workdir: str, pairs: bool) -> dict:
  """{"train": rows, "eval": rows, "bad_json": n}: posttrain.train_path (or the synthetic task,
  written into WORKDIR/posttrain_data) and posttrain.eval_path, else a fixed eval_fraction of the
  train rows."""
  p = cfg.posttrain
  path = p.train_path
  if not path:
    symbols = cfg.data.symbols if cfg.data.kind == "synthetic" else 10
    rows = synthetic_rows(p.synthetic_examples, symbols, cfg.train.seed, pairs)
    path = write_jsonl(
        rows, os.path.join(workdir, SYNTHETIC_DIR, "pairs.jsonl" if pairs else "sft.jsonl"))
  rows, bad = read_jsonl(path)
  if p.eval_path:
    held, bad_eval = read_jsonl(p.eval_path)
    return {"train": rows, "eval": held, "bad_json": bad + bad_eval}
  order = np.random.default_rng(0).permutation(len(rows))
  n_eval = int(np.ceil(p.eval_fraction * len(rows)))
  held = set(order[:n_eval].tolist())
  return {"train": [r for i, r in enumerate(rows) if i not in held],
          "eval": [rows[i] for i in sorted(held)], "bad_json": bad}


# ---- batches ----

def pack(lengths, capacity: int) -> list[list[int]]:
  """Example indices per row, in order: each row takes examples while they fit
  (lengths <= capacity)."""
  rows, row, used = [], [], 0
  for i, n in enumerate(lengths):
    if row and used + n > capacity:
      rows.append(row)
      row, used = [], 0
    row.append(i)
    used += n
  return rows + ([row] if row else [])


class Batches:
  """Rows lo:hi of consecutive global batches of `batch_size` rows; epochs of the examples in a
  fresh order each (train) or once in file order, then empty rows (eval). Random access by batch
  index, which is the whole state (exact resume). `render(example indices) -> dict of arrays` makes
  one row."""

  def __init__(self, n_examples: int, lengths, capacity: int, batch_size: int, lo: int, hi: int,
               seed: int, shuffle: bool, render):
    self.n, self.lengths, self.capacity, self.batch_size = n_examples, lengths, capacity, batch_size
    self.lo, self.hi, self.seed, self.shuffle, self.render = lo, hi, seed, shuffle, render
    self.index, self.epochs = 0, []  # epochs: packed rows of each epoch computed so far

  def _epoch(self, e: int) -> list[list[int]]:
    while len(self.epochs) <= e:
      k = len(self.epochs)
      order = (np.random.default_rng([self.seed, k]).permutation(self.n) if self.shuffle
               else np.arange(self.n))
      self.epochs.append([[int(order[i]) for i in row]
                          for row in pack([self.lengths[i] for i in order], self.capacity)])
    return self.epochs[e]

  def row(self, g: int) -> list[int]:
    """Example indices of global row g."""
    e = 0
    while g >= len(self._epoch(e)):
      if not self.shuffle:
        return []
      g -= len(self._epoch(e))
      e += 1
    return self._epoch(e)[g]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rows = [self.render(self.row(self.index * self.batch_size + r))
            for r in range(self.lo, self.hi)]
    self.index += 1
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def get_state(self) -> dict:
    return {"index": self.index}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])


def sft_row(examples, seq_len: int):
  """`indices -> row`: the examples packed into one [L] row (inputs, targets, segment_ids 1.. per
  example, positions restarting at 0, loss_mask on completion targets); attention never crosses
  examples."""
  def render(indices):
    row = {k: np.zeros(seq_len, np.int32)
           for k in ("inputs", "targets", "segment_ids", "positions")}
    row["loss_mask"] = np.zeros(seq_len, np.float32)
    at = 0
    for s, i in enumerate(indices, 1):
      ids, mask = examples[i]
      n = len(ids) - 1
      row["inputs"][at:at + n], row["targets"][at:at + n] = ids[:-1], ids[1:]
      row["segment_ids"][at:at + n], row["positions"][at:at + n] = s, np.arange(n)
      row["loss_mask"][at:at + n] = mask[1:]
      at += n
    return row
  return render


def pair_row(examples, seq_len: int):
  """`indices -> row`: one preference pair as [2, L] (chosen, rejected) full sequences: tokens,
  segment_ids (1 on tokens, 0 padding), positions, completion_mask; `valid` 0 for an empty (padding)
  row."""
  def render(indices):
    row = {k: np.zeros((2, seq_len), np.int32) for k in ("tokens", "segment_ids", "positions")}
    row["completion_mask"] = np.zeros((2, seq_len), np.float32)
    row["valid"] = np.float32(len(indices))
    for i in indices:
      for t, (ids, mask) in enumerate(examples[i]):
        n = len(ids)
        row["tokens"][t, :n], row["segment_ids"][t, :n], row["positions"][t, :n] = (
            ids, 1, np.arange(n))
        row["completion_mask"][t, :n] = mask
    return row
  return render


class Data:
  """A task's encoded splits: `Data(cfg, workdir, pairs)`; `.batches(split, lo, hi)`, `.counts`
  (kept and skipped rows by reason, per split)."""

  def __init__(self, cfg, workdir: str, pairs: bool):
    t = cfg.train
    self.cfg, self.pairs, self.seq_len = cfg, pairs, t.seq_len
    self.tokenizer = make_tokenizer(cfg, workdir)
    if getattr(self.tokenizer, "vocab_size", 0) > cfg.model.vocab_size:
      raise config_lib.ConfigError(
          f"the tokenizer has {self.tokenizer.vocab_size} ids, more than model.vocab_size="
          f"{cfg.model.vocab_size}")
    encoder = Encoder(self.tokenizer, t.seq_len if pairs else t.seq_len + 1)
    split = split_rows(cfg, workdir, pairs)
    self.examples, self.counts = {}, {}
    for name in ("train", "eval"):
      self.examples[name], self.counts[name] = encode_rows(split[name], encoder, cfg.posttrain,
                                                           pairs)
      self.counts[name]["examples"] = len(self.examples[name])
    self.counts["train"]["bad_json"] += split["bad_json"]
    if not self.examples["train"]:
      raise config_lib.ConfigError(f"posttrain: no usable training rows ({self.summary('train')})")

  def summary(self, split: str) -> str:
    c = self.counts[split]
    skipped = {k: v for k, v in c.items() if k in SKIPS and v}
    why = ", ".join(f"{k} {v}" for k, v in skipped.items())
    return (f"{split}: {c['examples']} examples, {sum(skipped.values())} skipped" +
            (f" ({why})" if why else "") +
            (f", {c['truncated']} truncated" if c["truncated"] else ""))

  def batches(self, split: str, lo: int, hi: int) -> Batches:
    examples = self.examples[split]
    if self.pairs:
      lengths, render = [self.seq_len] * len(examples), pair_row(examples, self.seq_len)
    else:
      lengths, render = [len(ids) - 1 for ids, _ in examples], sft_row(examples, self.seq_len)
    t = self.cfg.train
    return Batches(len(examples), lengths, self.seq_len, t.batch_size, lo, hi, t.seed,
                   split == "train", render)
