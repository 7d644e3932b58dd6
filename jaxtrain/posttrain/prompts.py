"""The RL prompts (JSONL rows with a prompt field, encoded and left-padded, bad rows counted) and
their batches, shuffled per epoch by the seed, with an exact-resume state: what GRPO and
PPO feed."""

import json

import numpy as np

from jaxtrain import config as config_lib


class Prompts:
  """The RL prompts: JSONL rows with a prompt field (other fields go to the reward functions),
  encoded as BOS + prompt, left-padded to `width` slots; rows that do not fit, lack the field, or do
  not parse are counted and skipped."""

  def __init__(self, path: str, tokenizer, width: int, prompt_field: str):
    self.counts = {"examples": 0, "prompt_too_long": 0, "missing_field": 0, "bad_json": 0,
                   "unencodable": 0}
    self.texts, self.fields, ids = [], [], []
    try:
      with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    except OSError as e:
      raise config_lib.ConfigError(f"posttrain.train_path={path}: {e.strerror or e}") from e
    for line in lines:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        self.counts["bad_json"] += 1
        continue
      if not isinstance(row, dict) or not isinstance(row.get(prompt_field), str):
        self.counts["missing_field"] += 1
        continue
      try:
        x = [int(i) for i in tokenizer.encode(row[prompt_field])]
      except ValueError:
        self.counts["unencodable"] += 1
        continue
      x = x if x[:1] == [tokenizer.bos] else [tokenizer.bos] + x
      if len(x) > width:
        self.counts["prompt_too_long"] += 1
        continue
      self.texts.append(row[prompt_field])
      self.fields.append({k: v for k, v in row.items() if k != prompt_field})
      ids.append(x)
    self.counts["examples"] = len(ids)
    if not ids:
      raise config_lib.ConfigError(f"{path}: no usable prompt ({self.counts})")
    self.ids_RP = np.zeros((len(ids), width), np.int32)
    self.lens_R = np.array([len(x) for x in ids], np.int32)
    for r, x in enumerate(ids):
      self.ids_RP[r, width - len(x):] = x  # left padding
    keys = set(self.fields[0])
    # fields every row has
    self.field_names = sorted(k for k in keys if all(k in f for f in self.fields))


class PromptBatches:
  """Consecutive global batches of prompt rows, shuffled per epoch by the seed; rows lo:hi of each,
  each batch `repeat` times (a rollout batch reused for that many steps, posttrain/reuse.py). State:
  the number of batches drawn (exact resume)."""

  def __init__(self, prompts: Prompts, batch_size: int, seed: int, lo: int, hi: int,
               repeat: int = 1):
    self.p, self.batch_size, self.seed, self.repeat = prompts, batch_size, seed, repeat
    self.lo, self.hi, self.drawn = lo, hi, 0

  def rows(self, index: int) -> np.ndarray:
    n = len(self.p.lens_R)
    flat = np.arange(index * self.batch_size, (index + 1) * self.batch_size)
    out = np.empty(len(flat), np.int64)
    for epoch in np.unique(flat // n):
      order = np.random.default_rng([self.seed, int(epoch)]).permutation(n)
      at = flat // n == epoch
      out[at] = order[flat[at] % n]
    return out

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rows = self.rows(self.drawn // self.repeat)[self.lo:self.hi]
    self.drawn += 1
    return {"prompts": self.p.ids_RP[rows], "prompt_lens": self.p.lens_R[rows],
            "row": rows.astype(np.int32)}

  def get_state(self) -> dict:
    return {"drawn": self.drawn}

  def set_state(self, state: dict) -> None:
    self.drawn = int(state["drawn"])
