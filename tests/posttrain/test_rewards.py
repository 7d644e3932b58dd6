"""The reward registry and the safe weighted evaluator."""

import math

import pytest

from jaxtrain.config import ConfigError
from jaxtrain.posttrain import rewards

PROMPTS = ["12+30=", "100+23=", "7+5=", "99+1="]
COMPLETIONS = ["24", "124\n", "21 apples", ""]  # exact.py's answers are reversed: 42, 123, 12


@pytest.fixture
def registered():
  """Names this test registers, removed afterwards so tests do not leak into each other."""
  added = []
  yield added
  for name in added:
    rewards._REGISTRY.pop(name, None)


def test_builtins():
  assert rewards.get("exact_match")(PROMPTS, COMPLETIONS) == [1.0, 0.0, 1.0, 0.0]
  assert rewards.get("exact_match")(PROMPTS, COMPLETIONS, answer=["24", "123", "13", ""]) == [1.0, 0.0, 0.0, 0.0]
  assert rewards.get("format")(PROMPTS, COMPLETIONS) == [1.0, 1.0, 0.0, 0.0]
  assert rewards.get("length_penalty")(PROMPTS, COMPLETIONS) == [-0.02, -0.04, -0.09, 0.0]
  assert set(rewards.BUILTINS) <= set(rewards.names())


def test_register_and_get(registered):
  @rewards.register("ends_in_four")
  def ends_in_four(prompts, completions, **_):
    return [float(c.endswith("4")) for c in completions]

  registered.append("ends_in_four")
  assert rewards.get("ends_in_four") is ends_in_four
  assert rewards.evaluate("ends_in_four", PROMPTS, COMPLETIONS)[0] == [1.0, 0.0, 0.0, 0.0]


def test_unknown_name_is_one_line_listing_the_registered():
  with pytest.raises(ConfigError) as e:
    rewards.get("exact_mtch")
  msg = str(e.value)
  assert "\n" not in msg and "'exact_mtch'" in msg
  assert all(name in msg for name in rewards.names())
  with pytest.raises(ConfigError, match="exact_mtch"):
    rewards.evaluate({"exact_match": 1.0, "exact_mtch": 1.0}, PROMPTS, COMPLETIONS)


def test_weights_sum_over_functions_and_callables_are_accepted():
  constant = lambda prompts, completions, **_: [0.5] * len(prompts)
  got, counts = rewards.evaluate([("exact_match", 2.0), (constant, -1.0), "format"], PROMPTS, COMPLETIONS)
  em, fmt = [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]
  assert got == [2.0 * e - 0.5 + f for e, f in zip(em, fmt)]
  assert counts["total"] == dict.fromkeys(rewards.FAULTS, 0)
  assert rewards.evaluate({"exact_match": 3.0}, PROMPTS, COMPLETIONS)[0] == [3 * e for e in em]
  assert rewards.evaluate(constant, PROMPTS, COMPLETIONS)[0] == [0.5] * 4


def test_row_fields_reach_the_functions():
  seen = {}

  def uses_fields(prompts, completions, answer, topic, **_):
    seen.update(answer=answer, topic=topic)
    return [float(c == a) for c, a in zip(completions, answer)]

  answers = ["24", "124\n", "0", "1"]
  got, _ = rewards.evaluate(uses_fields, PROMPTS, COMPLETIONS, answer=answers, topic=["t"] * 4)
  assert got == [1.0, 1.0, 0.0, 0.0] and seen == {"answer": answers, "topic": ["t"] * 4}


def test_faulty_functions_are_counted_and_zeroed_never_raised():
  def raises(prompts, completions, **_):
    raise RuntimeError("bug in a user's reward")

  def bad_values(prompts, completions, **_):
    return [math.nan, math.inf, "x", 0.25]

  def too_short(prompts, completions, **_):
    return [1.0]

  spec = [("exact_match", 1.0), (raises, 5.0), (bad_values, 2.0), (too_short, 7.0)]
  got, counts = rewards.evaluate(spec, PROMPTS, COMPLETIONS)
  assert got == [1.0, 0.0, 1.0 + 0.0, 0.5]  # only exact_match and bad_values' one finite value count
  assert counts["raises"] == {"raised": 4, "wrong_length": 0, "non_finite": 0}
  assert counts["bad_values"] == {"raised": 0, "wrong_length": 0, "non_finite": 3}
  assert counts["too_short"] == {"raised": 0, "wrong_length": 4, "non_finite": 0}
  assert counts["exact_match"] == dict.fromkeys(rewards.FAULTS, 0)
  assert counts["total"] == {"raised": 4, "wrong_length": 4, "non_finite": 3}
  _, counts = rewards.evaluate([raises, lambda p, c, **_: [1.0], lambda p, c, **_: [1.0] * 4], PROMPTS, COMPLETIONS)
  assert counts["<lambda>"]["wrong_length"] == 4 and counts["<lambda>_2"]["wrong_length"] == 0
  # exact_match on a prompt that is not an addition raises inside: counted, not fatal
  got, counts = rewards.evaluate("exact_match", ["hello"], ["1"])
  assert got == [0.0] and counts["total"]["raised"] == 1


def test_bad_specs_are_one_line_errors():
  for spec, match in [([], "no reward"), (("exact_match", math.nan), "finite"), (42, "registered name or a callable")]:
    with pytest.raises(ConfigError, match=match):
      rewards.resolve(spec)
  with pytest.raises(ConfigError, match="callable"):
    rewards.register("x")(3)
  with pytest.raises(ValueError, match="completions for"):
    rewards.evaluate("format", PROMPTS, COMPLETIONS[:2])
