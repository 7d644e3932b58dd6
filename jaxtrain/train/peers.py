"""The processes of a multi-process run (jax.distributed), through jax's distributed key-value store.

`agree(name, value)`: process 0's value on every process, without a device collective.
"""

import itertools
import json

_AGREEMENTS = {}  # name -> counter: every process calls agree() with the same names in the same order
AGREE_TIMEOUT_MS = 3600 * 1000  # a lost peer ends the run sooner (watch)


def _client():
  from jax._src import distributed  # the key-value store that orbax and jax's own multihost code use
  return distributed.global_state.client


def agree(name: str, value: str) -> str:
  """Process 0's `value` on every process (a string); one process: `value`."""
  import jax
  if jax.process_count() == 1:
    return value
  key = f"jaxtrain/agree/{name}/{next(_AGREEMENTS.setdefault(name, itertools.count()))}"
  if jax.process_index() == 0:
    _client().key_value_set(key, json.dumps(value))
    return value
  return json.loads(_client().blocking_key_value_get(key, AGREE_TIMEOUT_MS))
