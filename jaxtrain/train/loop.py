"""The composition root: config -> data -> model -> mesh -> optimizer -> jitted step -> loop.

`train(cfg, workdir)` and `sample(workdir, prompt, ...)` are the library entry points; the CLI
only parses flags and calls them.
"""

import contextlib
import functools
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jaxtrain import checkpoint, config as config_lib, data, metrics as metrics_lib, optim, parallel
from jaxtrain.model import ModelConfig, Transformer, active_mlp_params, generate, param_count
from jaxtrain.train import state as state_lib
from jaxtrain.train.preemption import Preemption
from jaxtrain.train.step import eval_step, train_step
from jaxtrain.train.workdir import check_workdir, load_config, write_config


class Feed:
  """Places this process's rows of each global batch as jax.Arrays sharded over the data axes.

  `lo:hi` are the global rows this process's devices hold; multi-host, each process builds only those."""

  def __init__(self, batch_size: int, seq_len: int, sharding):
    self.shape, self.sharding = (batch_size, seq_len), sharding
    self._rows = {d: idx[0] for d, idx in sharding.addressable_devices_indices_map(self.shape).items()}
    self.lo = min(r.start or 0 for r in self._rows.values())
    self.hi = max(batch_size if r.stop is None else r.stop for r in self._rows.values())

  def put(self, local: dict) -> dict:
    def place(x):
      shards = [jax.device_put(x[(r.start or 0) - self.lo:(self.shape[0] if r.stop is None else r.stop) - self.lo], d)
                for d, r in self._rows.items()]
      return jax.make_array_from_single_device_arrays(self.shape, self.sharding, shards)
    return {k: place(v) for k, v in local.items()}


class Batches(Feed):
  """Random access to global batch `index` of a source (synthetic, bytes): `batches(index)`."""

  def __init__(self, source, batch_size: int, seq_len: int, sharding):
    super().__init__(batch_size, seq_len, sharding)
    self.source = source

  def __call__(self, index: int) -> dict:
    return self.put(self.source.batch(index, self.lo, self.hi))


def peak_flops_total(cfg) -> tuple[float, str]:
  """Peak FLOP/s of the whole job: per device on accelerators, per host on CPU (shared cores)."""
  peak, source = metrics_lib.peak_flops(cfg.model.compute_dtype)
  units = jax.process_count() if jax.default_backend() == "cpu" else jax.device_count()
  return peak * units, source


def flops_per_token(cfg) -> float:
  """Training FLOPs per token, counting only the parameters a token uses (MoE: active experts)."""
  m = cfg.model
  return metrics_lib.train_flops_per_token(m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff,
                                           m.vocab_size, cfg.train.seq_len,
                                           mlp_params=active_mlp_params(ModelConfig.from_config(m)))


def build(cfg, devices=None):
  """Mesh, model, optimizer and schedule for a validated config."""
  mesh = parallel.make_mesh(cfg, devices)
  model = Transformer(ModelConfig.from_config(cfg.model))
  tx, schedule = optim.build(cfg)
  return mesh, model, tx, schedule


def compile_steps(cfg, mesh, model, tx, schedule, shardings):
  """The train and eval steps, jitted once with explicit shardings; the state is donated."""
  batch_sh = parallel.batch_sharding(mesh)
  step = functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                           microbatches=cfg.train.microbatches, z_loss=cfg.train.z_loss)
  train_fn = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, None),
                     donate_argnums=0)
  eval_fn = jax.jit(lambda params, extra, batch: eval_step(params, batch, model=model, extra=extra),
                    in_shardings=(shardings.params, shardings.extra, batch_sh))
  return train_fn, eval_fn


def evaluate(eval_fn, state, feed: Feed, batches, n: int) -> dict:
  """Token-mean loss over the first n batches of a fresh eval iterator (a fixed held-out set)."""
  sums, has_entropy = [], False
  for _, local in zip(range(n), batches):
    has_entropy = "entropy" in local
    sums.append(jax.device_get(eval_fn(state.params, state.extra, feed.put(local))))
  tokens = max(sum(float(s["tokens"]) for s in sums), 1.0)
  out = {"eval_loss": sum(float(s["ce"]) for s in sums) / tokens}
  if has_entropy:  # synthetic data: the exact entropy of these very tokens
    out["eval_entropy_floor"] = sum(float(s["entropy"]) for s in sums) / tokens
  return out


def prepare_corpus(cfg, workdir: str, progress: bool = True) -> dict:
  """Tokenizer and token caches for kind "text", made once by process 0; the others wait for them."""
  report = data.prepare_corpus(cfg, workdir, progress) if jax.process_index() == 0 else {}
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("jaxtrain_prepare")
    if jax.process_index() != 0:
      report = data.prepare_corpus(cfg, workdir, progress=False)  # finds and reuses the caches
  return report


def restore_state(ckpts: checkpoint.Checkpoints, model, tx, seq_len, mesh, rules_name, step=None):
  """The newest (or `step`) checkpoint read straight into its shardings (nothing initialized first):
  (state, shardings, data_state, restore metrics row)."""
  shardings = state_lib.state_shardings(model, tx, seq_len, mesh, rules_name)
  abstract = jax.eval_shape(state_lib.init_fn(model, tx, seq_len), 0)
  state, data_state, _, row = ckpts.restore(abstract, shardings, step)
  return state, shardings, data_state, row


def init_params(path: str, like):
  """The params of another run or a converted model (newest step), placed like `like` (the fresh
  params: same tree, shapes and shardings); a mismatch is one ConfigError line."""
  from jaxtrain.checkpoint import convert
  try:
    _, loaded = convert.load_params(path)
  except (FileNotFoundError, ValueError) as e:
    raise config_lib.ConfigError(f"checkpoint.init_from={path}: {e}") from e
  want = jax.tree_util.tree_flatten_with_path(like)[0]
  got = dict(jax.tree_util.tree_flatten_with_path(loaded)[0])
  for key, leaf in want:
    if key not in got or tuple(got[key].shape) != tuple(leaf.shape):
      found = "missing" if key not in got else f"shape {tuple(got[key].shape)}"
      raise config_lib.ConfigError(f"checkpoint.init_from={path}: {jax.tree_util.keystr(key)} is {found}, the "
                                   f"model needs {tuple(leaf.shape)}")
  return jax.tree_util.tree_map_with_path(
      lambda key, leaf: jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                                     lambda index: np.asarray(got[key][index], leaf.dtype)), like)


def checkpoint_meta(cfg, workdir: str) -> dict:
  """What a checkpoint carries beside the arrays: the config and the tokenizer reference."""
  ref = os.path.join(workdir, "tokenizer_ref.json")
  tokenizer = None
  if os.path.isfile(ref):
    with open(ref) as f:
      tokenizer = json.load(f)
  return {"config": cfg.to_dict(), "tokenizer": tokenizer}


def train(cfg, workdir: str, *, devices=None, progress: bool = True, sync_every_step: bool = False,
          start_over: bool = False) -> dict:
  """Trains `cfg` in `workdir` (resuming from its newest checkpoint); returns the last logged metrics.

  `devices` defaults to all; `sync_every_step` blocks on each step (many virtual CPU devices on few
  cores have deadlocked XLA's collectives when steps were dispatched ahead); `start_over` deletes
  the workdir's checkpoints and logs (needed when they come from an incompatible config)."""
  devices = jax.devices() if devices is None else devices
  config_lib.validate(cfg, len(devices))
  check_workdir(cfg, workdir, start_over)
  t = cfg.train
  mesh, model, tx, schedule = build(cfg, devices)
  rules = parallel.RULES[cfg.mesh.rules]

  # ---- data, opened before compiling: this process's rows of each global batch, with a state ----
  feed = Feed(t.batch_size, t.seq_len, parallel.batch_sharding(mesh))
  try:
    if cfg.data.kind == "text":
      prepare_corpus(cfg, workdir, progress and jax.process_index() == 0)
    where = (feed.lo, feed.hi, workdir, jax.process_index(), jax.process_count())
    train_iter = data.make_iterator(cfg, "train", *where)
    eval_iter = functools.partial(data.make_iterator, cfg, "eval", *where)
    if t.eval_every:
      eval_iter()  # fails now, not at the first evaluation
  except (FileNotFoundError, ValueError) as e:  # a missing corpus, no usable documents
    raise config_lib.ConfigError(str(e)) from e
  floor = getattr(getattr(train_iter, "source", None), "expected_entropy_floor", None)
  constants = {"entropy_floor": floor()} if floor else {}
  sizes = {"params": param_count(model.cfg), "active_params": param_count(model.cfg, active=True)}
  if progress and jax.process_index() == 0:
    print(f"model: {sizes['params']:,} parameters, {sizes['active_params']:,} active per token", flush=True)
  write_config(cfg, workdir)

  # ---- state: restored from the newest complete checkpoint of any tier, or born sharded ----
  writer = metrics_lib.MetricsWriter(workdir, enabled=jax.process_index() == 0)
  ckpts = checkpoint.Checkpoints(cfg, workdir)
  meta = checkpoint_meta(cfg, workdir)
  if ckpts.latest()[0] is not None:
    state, shardings, data_state, row = restore_state(ckpts, model, tx, t.seq_len, mesh, cfg.mesh.rules)
    train_iter.set_state(data_state)
    writer.write(int(state.step), row)
  else:
    state, shardings = state_lib.create_state(model, tx, t.seq_len, t.seed, mesh, cfg.mesh.rules)
    if cfg.checkpoint.init_from:
      state = state.replace(params=init_params(cfg.checkpoint.init_from, state.params))
  start = int(state.step)

  # ---- compile once, with the logical rules and mesh in context ----
  with contextlib.ExitStack() as stack:
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nn.logical_axis_rules(rules))
    train_fn, eval_fn = compile_steps(cfg, mesh, model, tx, schedule, shardings)
    flops = flops_per_token(cfg)
    peak, peak_source = peak_flops_total(cfg)
    bar = tqdm.tqdm(total=t.steps, initial=start, disable=not progress or jax.process_index() != 0,
                    dynamic_ncols=True)
    last, pending = {}, None
    tokens_per_step = t.batch_size * t.seq_len
    window_start, window_steps = time.perf_counter(), 0

    # ---- loop: dispatch step n, then read step n-1's metrics; SIGTERM/SIGINT: save and stop ----
    preemption = stack.enter_context(Preemption())
    adaptive = any(tier.adaptive for tier in ckpts.tiers)
    for step in range(start, t.steps):
      state, step_metrics = train_fn(state, feed.put(next(train_iter)))
      if sync_every_step:
        jax.block_until_ready(step_metrics)
      if pending is not None:
        if adaptive:  # the previous step's health, read while this one runs
          _observe(ckpts, writer, pending)
        row = _log_step(pending, writer, bar, constants, flops, peak, window_start, window_steps, tokens_per_step)
        if row:
          last, window_start, window_steps = row, time.perf_counter(), 0
      window_steps += 1
      is_last = step + 1 == t.steps
      # The first step is always logged alone: its time includes compilation, later windows' do not.
      pending = (step + 1, step_metrics, is_last or step == start or (step + 1) % t.log_every == 0, {})
      if t.eval_every and ((step + 1) % t.eval_every == 0 or is_last):
        result = evaluate(eval_fn, state, feed, eval_iter(), t.eval_batches)
        pending = (step + 1, step_metrics, True, result)  # logged in the same row as the step
        if not bar.disable:
          bar.write(f"step {step + 1}: " + ", ".join(f"{k}={v:.4f}" for k, v in result.items()))
      if preemption.check(step + 1):
        pending = (*pending[:2], True, pending[3])
        last["preempted"] = preemption.requested
        break
      if not is_last and (due := ckpts.due(step + 1)):
        _log_decisions(writer, step + 1, ckpts.save(step + 1, state, train_iter.get_state(), meta, due))
      for record in ckpts.finished_saves():
        writer.write(record.step, record.row())
      ckpts.check()  # SaveFailed after checkpoint.max_failed_saves failed saves of a tier in a row
    if pending is not None:
      last.update(_log_step(pending, writer, bar, constants, flops, peak, window_start, window_steps,
                            tokens_per_step))

  # ---- the end (also after a preemption): a forced save to the persistent tier, close sinks ----
  ckpts.save(int(state.step), state, train_iter.get_state(), meta, ckpts.persistent())
  ckpts.wait()
  for record in ckpts.finished_saves():
    writer.write(record.step, record.row())
  ckpts.close()
  bar.close()
  writer.close()
  ckpts.check(final=True)  # SaveFailed when the final save failed
  last.update({"peak_flops": peak, "peak_source": peak_source, "step": int(state.step), **sizes, **constants})
  return last


def _observe(ckpts, writer, pending):
  """Feeds a finished step's loss, grad norm and skipped count to the adaptive save policy."""
  step, step_metrics = pending[:2]
  values = jax.device_get({k: step_metrics[k] for k in ("loss", "grad_norm", "skipped_steps")})
  _log_decisions(writer, step, ckpts.observe(step, float(values["loss"]), float(values["grad_norm"]),
                                              float(values["skipped_steps"])))


def _log_decisions(writer, step: int, decisions: list[str]):
  for decision in decisions:
    writer.write(step, {"event": "checkpoint_policy", "decision": decision})


def _log_step(pending, writer, bar, constants, flops, peak, window_start, window_steps, tokens_per_step):
  """Reads a finished step's metrics (and its eval results); logs them when due. Returns the row or {}."""
  step, step_metrics, due, extra = pending
  if not due:
    return {}
  values = {**{k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
               for k, v in jax.device_get(step_metrics).items()}, **extra}
  step_time = (time.perf_counter() - window_start) / max(window_steps, 1)
  tokens_per_sec = tokens_per_step / step_time
  row = {**values, "tokens_per_sec": tokens_per_sec, "mfu": flops * tokens_per_sec / peak,
         "step_time_s": step_time, **constants}
  writer.write(step, row)
  bar.update(step - bar.n)
  bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{row['mfu']:.1%}")
  return row


def sample(workdir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int = 0,
           devices=None) -> str:
  """Text continuation of `prompt` by the model trained in `workdir` (newest checkpoint)."""
  if max_new_tokens < 1 or temperature < 0 or top_k < 0:
    raise config_lib.ConfigError("sample: max_new_tokens must be >= 1, temperature and top_k >= 0")
  cfg = load_config(workdir)
  tokenizer = data.make_tokenizer(cfg, workdir)
  try:
    prompt_ids = np.concatenate([[tokenizer.bos], tokenizer.encode(prompt)]).astype(np.int32)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e
  if len(prompt_ids) + max_new_tokens > cfg.model.max_seq_len:
    raise config_lib.ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                                 f"exceeds model.max_seq_len={cfg.model.max_seq_len}")
  ckpts = checkpoint.Checkpoints(cfg, workdir, read_only=True)
  if ckpts.latest()[0] is None:
    raise config_lib.ConfigError(f"no checkpoint in {workdir}; train first")
  cfg.mesh.update({"replica": 1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1})
  mesh, model, tx, _ = build(cfg, devices or jax.local_devices()[:1])
  state = restore_state(ckpts, model, tx, cfg.train.seq_len, mesh, cfg.mesh.rules)[0]
  ckpts.close()
  gen = jax.jit(generate, static_argnums=(0, 4, 5, 6))
  tokens = gen(model, state.params, jnp.asarray(prompt_ids)[None], jax.random.key(seed), max_new_tokens,
               temperature, top_k, state.extra)
  out = np.asarray(tokens[0])
  if tokenizer.eos in out:  # stop at the end of the document
    out = out[: list(out).index(tokenizer.eos) + 1]
  return tokenizer.decode(out)
