"""Log-likelihood of continuations given contexts, the scoring core of evaluation
(lm-evaluation-harness's `loglikelihood` and `loglikelihood_rolling`).

Requests are packed into [rows, length] batches with segment ids and per-document positions, as
training packs documents (Levanter's eval_harness), and attention never crosses requests. Requests
with the same context (a multiple-choice doc's choices) share one document: the context once, then
each continuation as a branch that sees the context and itself only (the model's branch ids), so a
context is computed once, not once per choice (`Unit`; `share_contexts=False`: each alone). A call's
row length is a power of two (at most seq_len, at least its longest request) chosen for the fewest
FLOPs: its packed rows' slots times the forward FLOPs per slot at that length (rows of a length
short requests fill well, without attention over the model's whole length); a batch has at most
rows * seq_len / length rows (no more tokens than `rows` rows of seq_len), a call's rows shared
evenly among its batches (one compiled program a call's shape). A request whose context +
continuation does not fit is cut from the left of its context (counted in `Score.truncated`), as
the harness does.
"""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib, metrics, parallel
from jaxtrain.model import ModelConfig, Transformer


class Request(NamedTuple):
  """Token ids: `context` (at least one, e.g. BOS) and the `continuation` it is scored on."""
  context: np.ndarray
  continuation: np.ndarray


class Score(NamedTuple):
  """Sum of the continuation's log-probs, whether every continuation token is the argmax, and how
  many context tokens were cut from the left to fit the model's length."""
  logprob: float
  is_greedy: bool
  truncated: int


def fit(request: Request, seq_len: int) -> tuple[np.ndarray, int]:
  """(context + continuation, cut from the left so that its inputs fit seq_len; tokens cut)."""
  n_ctx, n_cont = len(request.context), len(request.continuation)
  if n_ctx < 1 or n_cont < 1:
    raise config_lib.ConfigError(
        f"a request needs a context and a continuation of at least one token each, got {n_ctx} "
        f"and {n_cont}")
  if n_cont > seq_len:
    raise config_lib.ConfigError(
        f"a continuation of {n_cont} tokens is longer than the model's length {seq_len}")
  cut = max(0, n_ctx + n_cont - 1 - seq_len)
  return np.concatenate([request.context[cut:], request.continuation]).astype(np.int32), cut


class Branch(NamedTuple):
  """One request in a unit: the context's last token then the continuation but its last (`inputs`),
  each predicting the next token of the continuation (`targets`)."""
  request: int
  inputs: np.ndarray
  targets: np.ndarray


class Unit(NamedTuple):
  """One packed document: `trunk`, a fitted context but its last token (no request is scored on
  it), then its branches, each seeing the trunk and itself only (the model's branch ids). The
  requests with one fitted context share a unit (a multiple-choice doc's choices); a request alone
  is a unit of one branch, the same slots as its context + continuation in a document of its own."""
  trunk: np.ndarray
  branches: list[Branch]


def unit_length(unit: Unit) -> int:
  return len(unit.trunk) + sum(len(b.inputs) for b in unit.branches)


def units(requests: list[Request], fitted: list[np.ndarray], length: int,
          share: bool = True) -> list[Unit]:
  """The requests (`fitted`: each one's context + continuation as `fit` cut it) as units of at most
  `length` input slots, which must hold each request alone: the requests of one fitted context in
  one unit (`share`), in as many as it takes when they do not fit in one."""
  groups = {}
  for i, (request, full) in enumerate(zip(requests, fitted)):
    context = full[:-len(request.continuation)]
    branch = Branch(i, full[len(context) - 1:-1], full[len(context):])
    groups.setdefault(context.tobytes() if share else i, (context[:-1], []))[1].append(branch)
  out = []
  for trunk, branches in groups.values():
    room = 0
    for branch in branches:
      if len(branch.inputs) > room:
        out.append(Unit(trunk, []))
        room = length - len(trunk)
      out[-1].branches.append(branch)
      room -= len(branch.inputs)
  return out


class Span(NamedTuple):
  """Where one request's scored slots lie in a batch: its row, and slots start to end."""
  request: int
  row: int
  start: int
  end: int


def pack(units_: list[Unit], rows: int, length: int):
  """Yields (batch of [rows, length] numpy arrays, spans): the units, longest first, each in the
  first row of the open batch with room (first-fit decreasing). Segment ids 1, 2, ... a unit within
  its row (0: padding); branch ids 0 on a unit's trunk, 1, 2, ... on its branches; positions from 0
  along the trunk, each branch's continuing the trunk's; targets 0 where nothing is scored."""
  sizes = [unit_length(u) for u in units_]
  order = sorted(range(len(units_)), key=lambda i: -sizes[i])
  while order:
    batch = {k: np.zeros((rows, length), np.int32)
             for k in ("inputs", "targets", "segment_ids", "branch_ids", "positions")}
    free, docs, spans, rest = [0] * rows, [0] * rows, [], []
    smallest = sizes[order[-1]]
    for k, i in enumerate(order):
      if length - min(free) < smallest:  # no row has room for any unit left
        rest.extend(order[k:])
        break
      row = next((b for b in range(rows) if free[b] + sizes[i] <= length), None)
      if row is None:
        rest.append(i)
        continue
      docs[row] += 1
      trunk, at = units_[i].trunk, free[row]
      parts = [(trunk, np.zeros_like(trunk), 0, None)] + [
          (b.inputs, b.targets, j, b.request) for j, b in enumerate(units_[i].branches, 1)]
      for inputs, targets, branch, request in parts:
        end = at + len(inputs)
        batch["inputs"][row, at:end], batch["targets"][row, at:end] = inputs, targets
        batch["segment_ids"][row, at:end], batch["branch_ids"][row, at:end] = docs[row], branch
        batch["positions"][row, at:end] = (len(trunk) if branch else 0) + np.arange(len(inputs))
        if request is not None:
          spans.append(Span(request, row, at, end))
        at = end
      free[row] = at
    yield batch, spans
    order = rest


def token_scores(model: Transformer, params, extra, batch):
  """Per input slot: the log-prob of the next token and whether it is the argmax ([B, L] each).
  Branch ids only where the batch has them (shared contexts)."""
  logits_BLV = model.apply({"params": params, **extra}, batch["inputs"], batch["positions"],
                           batch["segment_ids"],
                           branch_ids_BL=batch.get("branch_ids")).astype(jnp.float32)
  targets_BL = batch["targets"]
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  logprob_BL = target_logit_BL - jax.nn.logsumexp(logits_BLV, axis=-1)
  return logprob_BL, jnp.argmax(logits_BLV, axis=-1) == targets_BL


def rolling_requests(ids: np.ndarray, prefix: int, seq_len: int) -> list[Request]:
  """A text's ids as disjoint windows of seq_len predicted tokens: the first conditioned on `prefix`
  (BOS), each next one on the last token of the window before (lm-evaluation-harness's
  get_rolling_token_windows with context_len=1). Every token is predicted exactly once."""
  ids = np.asarray(ids, np.int32)
  windows = []
  for start in range(0, len(ids), seq_len):
    context = np.array([prefix], np.int32) if start == 0 else ids[start - 1:start]
    windows.append(Request(context, ids[start:start + seq_len]))
  return windows


def host_values(arrays):
  """The arrays' global values on this host. Rows lie over the data axes, across processes in a
  multi-process run, and every process needs every row (the requests it reads back are all of
  them): there they are all-gathered, on one process only copied."""
  if jax.process_count() == 1:
    return jax.device_get(arrays)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(arrays, tiled=True)


MIN_ROW_LEN = 16  # the shortest packed row: fewer programs to compile for very short requests
# the longest row whose requests share their contexts: branched attention materializes the
# [rows, heads, L, L] scores (model/attention.branched_attention); longer rows score each alone
SHARE_UP_TO = 2048
PACKING_SAMPLE = 512  # requests whose first-fit packing estimates a row length's rows


def rows_at(length: int, rows: int, seq_len: int) -> int:
  """A batch's rows at row `length`: rows * seq_len tokens, a multiple of `rows` (so that they
  still divide over the data axes)."""
  return rows * max(1, seq_len // length)


def packed_rows(lengths_desc: list[int], length: int) -> int:
  """Rows that first-fit decreasing packing fills with requests of these input lengths (longest
  first), estimated on at most PACKING_SAMPLE of them, evenly spaced."""
  step = -(-len(lengths_desc) // PACKING_SAMPLE) or 1
  free = []  # room left in each row
  for n in lengths_desc[::step]:
    row = next((i for i, f in enumerate(free) if n <= f), None)
    if row is None:
      free.append(length - n)
    else:
      free[row] -= n
  return len(free) * step


def batch_rows(needed: int, most: int, multiple: int) -> int:
  """Rows a batch: as few batches as `most` rows each allow for `needed` rows, the rows shared
  evenly among them (a multiple of `multiple`, the data shards), so that the last batch is not
  mostly padding."""
  batches = -(-needed // most)
  return min(most, -(-needed // (batches * multiple)) * multiple)


def row_length(rows_needed, longest: int, rows: int, seq_len: int, flops_per_token) -> int:
  """The power-of-two row length (MIN_ROW_LEN to seq_len, at least `longest`, the longest request's
  inputs) with the fewest forward FLOPs: the rows a call runs at that length (`rows_needed(length)`
  packed rows, in batches of batch_rows), times `flops_per_token(length)` (attention grows with the
  length)."""
  candidates = sorted({min(seq_len, max(MIN_ROW_LEN, 1 << k))
                       for k in range(max(longest - 1, 0).bit_length(), seq_len.bit_length() + 1)})
  def cost(length):
    needed = rows_needed(length)
    per_batch = batch_rows(needed, rows_at(length, rows, seq_len), 1)
    return -(-needed // per_batch) * per_batch * length * flops_per_token(length)
  return min(candidates, key=cost)


class Scorer:
  """Scores requests with one model: `loglikelihood(requests) -> [Score]`, batches of `rows` rows of
  `seq_len` tokens (default the model's max_seq_len), or more, shorter rows for short requests
  (row_length), each shape compiled once. With a `mesh`, rows lie over its data
  axes and the params as `mesh_rules` (config.RULES) shards them; without one, on one device."""

  def __init__(self, model_cfg: ModelConfig, params, extra=None, rows: int = 8,
               seq_len: int | None = None, mesh=None, mesh_rules: str = "fsdp",
               share_contexts: bool = True):
    self.model = Transformer(model_cfg)
    self.share_contexts = share_contexts
    self.seq_len = seq_len or model_cfg.max_seq_len
    if not 1 <= self.seq_len <= model_cfg.max_seq_len:
      raise config_lib.ConfigError(
          f"eval seq_len={self.seq_len} must be in [1, model.max_seq_len={model_cfg.max_seq_len}]")
    self.mesh, self.mesh_rules = mesh, mesh_rules
    extra = extra or {}
    self.shards = 1 if mesh is None else int(
        np.prod([mesh.shape[a] for a in parallel.DATA_AXES]))  # rows a batch comes in multiples of
    if mesh is None:
      self.rows = rows
      self.params, self.extra = jax.device_put((params, extra), jax.local_devices()[0])
    else:
      self.rows = -(-rows // self.shards) * self.shards
      self.params = jax.device_put(params, self._param_shardings(mesh, mesh_rules))
      self.extra = jax.device_put(extra, NamedSharding(mesh, P()))
    self._step = jax.jit(functools.partial(token_scores, self.model))

  def _flops_per_token(self, length: int) -> float:
    """A packed slot's forward matmul FLOPs at row `length` (the dense formula: enough to rank
    row lengths)."""
    m = self.model.cfg
    return metrics.train_flops_per_token(m.n_layers, m.d_model, m.n_heads, m.n_kv_heads,
                                         m.head_dim, m.d_ff, m.vocab_size, length) / 3

  def _param_shardings(self, mesh, mesh_rules: str):
    """The params' shardings from the model's logical axis names."""
    boxed = jax.eval_shape(self.model.init, jax.random.key(0),
                           jnp.zeros((1, self.seq_len), jnp.int32))
    return parallel.logical_shardings(nn.get_partition_spec(boxed)["params"], mesh, mesh_rules)

  def _run(self, batch):
    if self.mesh is None:
      return self._step(self.params, self.extra, batch)
    with parallel.activate(self.mesh, self.mesh_rules):
      return self._step(self.params, self.extra,
                        jax.device_put(batch, parallel.batch_sharding(self.mesh)))

  def loglikelihood(self, requests: list[Request]) -> list[Score]:
    """A Score per request, in order."""
    if not requests:
      return []
    fitted, cuts = zip(*[fit(r, self.seq_len) for r in requests])
    top = max(int(full.max()) for full in fitted)
    if top >= self.model.cfg.vocab_size:
      raise config_lib.ConfigError(f"token id {top} is outside the model's vocabulary "
                                   f"(vocab_size={self.model.cfg.vocab_size}): another tokenizer?")

    @functools.cache
    def units_at(length):
      return units(requests, fitted, length, self.share_contexts and length <= SHARE_UP_TO)

    @functools.cache
    def rows_needed(length):
      return packed_rows(sorted(map(unit_length, units_at(length)), reverse=True), length)

    length = row_length(rows_needed, max(len(full) - 1 for full in fitted), self.rows,
                        self.seq_len, self._flops_per_token)
    shared = any(len(u.branches) > 1 for u in units_at(length))
    rows = batch_rows(rows_needed(length), rows_at(length, self.rows, self.seq_len), self.shards)
    out = [None] * len(requests)
    pending = None  # dispatch batch n, then read batch n-1
    for batch, spans in [*pack(units_at(length), rows, length), (None, None)]:
      if batch is not None and not shared:  # the plain document mask: any attention kernel
        del batch["branch_ids"]
      running = (self._run(batch), spans) if batch is not None else None
      if pending is not None:
        (logprob_BL, greedy_BL), done = host_values(pending[0]), pending[1]
        for s in done:
          out[s.request] = Score(float(np.sum(logprob_BL[s.row, s.start:s.end], dtype=np.float64)),
                                 bool(np.all(greedy_BL[s.row, s.start:s.end])), cuts[s.request])
      pending = running
    return out

  def rolling_loglikelihood(self, texts_ids: list[np.ndarray], prefix: int) -> list[float]:
    """The summed log-prob of every token of each text (ids without BOS), in disjoint windows of
    seq_len after `prefix` (rolling_requests)."""
    windows = [rolling_requests(ids, prefix, self.seq_len) for ids in texts_ids]
    scores = iter(self.loglikelihood([w for text in windows for w in text]))
    return [sum(next(scores).logprob for _ in text) for text in windows]
