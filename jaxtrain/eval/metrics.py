"""Metrics of the generative and classification tasks: pass@k, macro-F1, SQuAD token F1, and the
answer normalisation exact match compares after."""

import collections
import re
import string

import numpy as np

NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased estimator of pass@k from n samples of which c pass, 1 - C(n-c, k) / C(n, k),
  as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i) (Chen et al., 2021, "Evaluating Large Language
  Models Trained on Code", fig. 3): no huge binomials."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k: needs 0 <= c={c} <= n={n} and 1 <= k={k} <= n")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def macro_f1(gold: list, predicted: list) -> float:
  """scikit-learn's f1_score(gold, predicted, average="macro"): F1 = 2 tp / (2 tp + fp + fn) per
  label of those that occur as gold or predicted, averaged unweighted (a label that occurs on one
  side only scores 0)."""
  if len(gold) != len(predicted) or not gold:
    raise ValueError(f"macro_f1: {len(gold)} gold and {len(predicted)} predicted labels")
  f1s = []
  for label in sorted(set(gold) | set(predicted)):
    tp = sum(g == label and p == label for g, p in zip(gold, predicted))
    fp = sum(g != label and p == label for g, p in zip(gold, predicted))
    fn = sum(g == label and p != label for g, p in zip(gold, predicted))
    f1s.append(2 * tp / (2 * tp + fp + fn))
  return float(np.mean(f1s))


def normalize_number(text: str) -> str:
  """A number's text without thousands separators, a leading '+' or '$', or a trailing '.';
  '3.50' stays '3.50' (no numeric comparison)."""
  return text.strip().replace(",", "").lstrip("+$").rstrip(".")


def is_number(text: str) -> bool:
  return NUMBER.fullmatch(normalize_number(text)) is not None


def extract_answer(text: str, gold: str, answer_regex: str | None) -> str:
  """The answer in a generation: with answer_regex, its last match (group 1 when it has groups);
  else for a numeric gold the last number in the text (lm-eval's gsm8k "flexible-extract"); else
  the stripped text. Numbers lose commas, '$' and a trailing '.'; "" when nothing matches."""
  if answer_regex is not None:
    matches = re.findall(answer_regex, text)
    found = matches[-1] if matches else ""
    found = next((g for g in found if g), "") if isinstance(found, tuple) else found
  elif is_number(gold):
    matches = NUMBER.findall(text)
    found = matches[-1] if matches else ""
  else:
    return text.strip()
  found = found.strip()
  return normalize_number(found) if is_number(found) else found


def exact_match(text: str, gold: str, answer_regex: str | None = None) -> float:
  """1.0 when the extracted answer equals the gold (both normalised), else 0.0."""
  gold = normalize_number(gold) if is_number(gold) else gold.strip()
  return float(extract_answer(text, gold, answer_regex) == gold)


def squad_tokens(text: str) -> list[str]:
  """SQuAD v1.1's normalize_answer, split on whitespace: lower case, no punctuation, no articles."""
  text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
  return re.sub(r"\b(a|an|the)\b", " ", text).split()


def token_f1(prediction: str, reference: str) -> float:
  """SQuAD's token-level F1 of the bags of normalised tokens; two empty texts score 1, one 0."""
  pred, ref = squad_tokens(prediction), squad_tokens(reference)
  if not pred or not ref:
    return float(pred == ref)
  common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(pred), common / len(ref)
  return 2 * precision * recall / (precision + recall)
