"""Rewards on decoded text for RL (PPO, GRPO): a registry by name, and a safe weighted batch
evaluator.

A reward function has the signature

    # one float per sample
    fn(prompts: list[str], completions: list[str], **row_fields) -> list[float]

where row_fields are the data rows' other fields, one list per field aligned with prompts (e.g.
answer=[...] from an eval/RL JSONL). A function should accept **row_fields and ignore what it does
not use. Configs name rewards ("exact_match"); the library API also takes the callable itself
wherever a name is accepted (`resolve`). `register("name")(fn)` adds one by name, e.g. from a
user's module before `jaxtrain.train(cfg, workdir)`.

`evaluate` never raises on a reward function's fault: a function that raises, returns the wrong
number of values, or a value that is not a finite number, gives 0 to the samples concerned (all of
its batch when it raised or returned the wrong length) and the event is counted by kind, so a run
logs it and goes on.
"""

import math
from collections.abc import Callable, Sequence

from jaxtrain.config import ConfigError
from jaxtrain.posttrain import exact

RewardFn = Callable[..., Sequence[float]]
FAULTS = ("raised", "wrong_length", "non_finite")  # the kinds of faults `evaluate` counts


def exact_match(prompts, completions, answer=None, **_):
  """1.0 when the completion's leading digits are exactly the answer: the rows' `answer` field when
  they have one (any task; needed for exact.py's reversed answers), else the sum the addition prompt
  asks for (jaxtrain/posttrain/exact.py). An empty answer never matches."""
  if answer is None:
    return [exact.score(p, c) for p, c in zip(prompts, completions)]
  return [float(exact.parse_completion(c) == str(a) != "") for c, a in zip(completions, answer)]


def format_reward(prompts, completions, **_):
  """1.0 when the completion is a bare number: digits only, optionally ending in one newline."""
  del prompts
  return [float(bool(c) and c.removesuffix("\n").isdigit()) for c in completions]


def length_penalty(prompts, completions, **_):
  """-(characters of the completion) / 100: a small push toward short answers."""
  del prompts
  return [-len(c) / 100 for c in completions]


_REGISTRY: dict[str, RewardFn] = {"exact_match": exact_match, "format": format_reward,
                                  "length_penalty": length_penalty}
BUILTINS = tuple(_REGISTRY)


def register(name: str):
  """Decorator: `@register("mine")` makes fn available as reward "mine"; re-registering a name
  replaces it."""
  if not isinstance(name, str) or not name:
    raise ConfigError(f"rewards.register: the name must be a non-empty string, got {name!r}")

  def add(fn: RewardFn) -> RewardFn:
    if not callable(fn):
      raise ConfigError(f"rewards.register({name!r}): {fn!r} is not callable")
    _REGISTRY[name] = fn
    return fn

  return add


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> RewardFn:
  """The reward registered as `name`; ConfigError (one line) naming the registered ones
  otherwise."""
  if name not in _REGISTRY:
    raise ConfigError(f"reward {name!r} is not registered; registered: {', '.join(names())} "
                      "(add one with jaxtrain.posttrain.rewards.register)")
  return _REGISTRY[name]


def resolve(spec) -> list[tuple[str, RewardFn, float]]:
  """(label, fn, weight) triples from a name, a callable, a (name or callable, weight) pair, a
  {name: weight} dict, or a list of any of these. Weights default to 1 and must be finite."""
  if hasattr(spec, "items"):  # a dict or a config's ConfigDict
    items = list(spec.items())
  elif isinstance(spec, (list, tuple)) and not _is_pair(spec):
    items = [s if _is_pair(s) else (s, 1.0) for s in spec]
  else:
    items = [spec if _is_pair(spec) else (spec, 1.0)]
  out = []
  for what, weight in items:
    if not isinstance(weight, (int, float)) or not math.isfinite(weight):
      raise ConfigError(f"reward {what!r}: weight {weight!r} must be a finite number")
    if callable(what):
      out.append((getattr(what, "__name__", repr(what)), what, float(weight)))
    elif isinstance(what, str):
      out.append((what, get(what), float(weight)))
    else:
      raise ConfigError(f"reward {what!r}: expected a registered name or a callable")
  if not out:
    raise ConfigError("no reward function given")
  return out


def _is_pair(x) -> bool:
  return (isinstance(x, (list, tuple)) and len(x) == 2 and (isinstance(x[0], str) or callable(x[0]))
          and isinstance(x[1], (int, float)) and not isinstance(x[1], bool))


def evaluate(fns_with_weights, prompts: Sequence[str], completions: Sequence[str],
             **row_fields) -> tuple[list[float], dict]:
  """(rewards, counts): rewards[i] = sum over functions of weight * fn(...)[i], where a faulty value
  counts 0 (see the module docstring); counts = {label: {fault: n}} with the number of faulty
  *samples* of each kind for each function (its name; `name_i` for the i-th function when taken),
  and "total" summing them over functions. `fns_with_weights`: any spec `resolve` takes."""
  prompts, completions = list(prompts), list(completions)
  n = len(prompts)
  if len(completions) != n:
    raise ValueError(f"rewards.evaluate: {len(completions)} completions for {n} prompts")
  rewards = [0.0] * n
  counts = {"total": dict.fromkeys(FAULTS, 0)}
  for i, (label, fn, weight) in enumerate(resolve(fns_with_weights)):
    values, faults = _call(fn, prompts, completions, row_fields, n)
    # two lambdas: <lambda>, <lambda>_1
    counts[label if label not in counts else f"{label}_{i}"] = faults
    for kind, k in faults.items():
      counts["total"][kind] += k
    for i, v in enumerate(values):
      rewards[i] += weight * v
  return rewards, counts


def _call(fn, prompts, completions, row_fields, n) -> tuple[list[float], dict]:
  """fn's n values with faults replaced by 0, and the fault counts (in samples)."""
  faults = dict.fromkeys(FAULTS, 0)
  try:
    values = list(fn(list(prompts), list(completions), **row_fields))
  except Exception:  # a user's reward function: any failure is counted, never fatal
    faults["raised"] = n
    return [0.0] * n, faults
  if len(values) != n:
    faults["wrong_length"] = n
    return [0.0] * n, faults
  out = []
  for v in values:
    try:
      x = float(v)
    except (TypeError, ValueError):
      x = math.nan
    if not math.isfinite(x):
      faults["non_finite"] += 1
      x = 0.0
    out.append(x)
  return out, faults
