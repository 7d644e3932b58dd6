"""Where one train step's time goes, torch eager and jaxtrain side by side (vs_torch.py --profile).

torch: `torch.profiler` self-CPU time of each aten op over `steps` steps, each op placed in the
phase (forward, backward, clip, optimizer) a `record_function` around that part of the step names.
jaxtrain: a `jax.profiler` trace of its compiled step on XLA:CPU, one event per thunk (the HLO
instruction it runs, `hlo_op`), each instruction classed from the optimized HLO text of the same
executable: the ops it fuses, their shapes, and the `op_name` jax wrote (jvp / transpose(jvp) for
forward / backward, flax module paths). Both are put in the same categories, and the matmul
GFLOP/s of the step's matmul shapes is measured in each framework, interleaved.
"""

import collections
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

CATEGORIES = ("matmul", "attention", "norm/elementwise", "copy/transpose", "optimizer", "other")
PHASES = ("forward", "backward", "optimizer")

# torch: ops by name (after the phase: clip and optimizer ops are "optimizer")
TORCH_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
TORCH_LAYOUT = ("copy_", "clone", "contiguous", "cat", "transpose", "permute", "reshape", "view",
                "aten::t", "as_strided", "slice", "split", "chunk", "expand", "_unsafe_view",
                "select", "unsqueeze", "squeeze", "empty", "zeros", "fill_", "zero_", "detach",
                "_to_copy", "aten::to", "stack", "narrow")
TORCH_ELEMENTWISE = ("norm", "mul", "add", "sub", "silu", "neg", "rsqrt", "pow", "mean", "div",
                     "sum", "sigmoid", "where")
# XLA: opcodes that only move data
HLO_LAYOUT = {"parameter", "copy", "transpose", "bitcast", "reshape", "slice", "concatenate",
              "broadcast", "pad", "dynamic-slice", "dynamic-update-slice", "constant", "tuple",
              "get-tuple-element", "iota"}
HLO_CONTROL = {"conditional", "while", "call"}  # their nested thunks report their own time
# op_name parts of the attention core (scores, mask, softmax, probabilities x values), not RoPE's
ATTENTION_CORE = ("BHLS", "reduce_max", "/exp", "jit(_where)", "select_n")


# ---------------------------------------------------------------------------------------------
# torch


def torch_step_in_phases(t, tokens_BL):
  """vs_torch.Torch.step with each part inside a `record_function` naming its phase."""
  torch = t.torch
  rf = torch.profiler.record_function
  x = torch.from_numpy(np.ascontiguousarray(tokens_BL)).long()
  with rf("phase:forward"):
    logits = t.forward(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, t.vocab), x[:, 1:].reshape(-1))
  t.opt.zero_grad(set_to_none=True)
  with rf("phase:backward"):
    loss.backward()
  with rf("phase:clip"):
    torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.clip)
  with rf("phase:optimizer"):
    t.opt.step()
  float(loss.detach())


def _torch_phase(event) -> str:
  while event is not None:
    if event.name.startswith("phase:"):
      name = event.name[len("phase:"):]
      return "optimizer" if name == "clip" else name
    event = event.cpu_parent
  return "other"


def torch_category(name: str, phase: str) -> str:
  if phase == "optimizer":
    return "optimizer"
  if name in TORCH_MATMUL:
    return "matmul"
  if "scaled_dot_product" in name or "flash_attention" in name:
    return "attention"
  if any(k in name for k in TORCH_LAYOUT):
    return "copy/transpose"
  if any(k in name for k in TORCH_ELEMENTWISE):
    return "norm/elementwise"
  return "other"


def profile_torch(trainer, batches, steps: int) -> dict:
  """Self-CPU seconds per step of each op (by name), category and phase; the profiled step's wall
  time."""
  import torch
  activities = [torch.profiler.ProfilerActivity.CPU]
  with torch.profiler.profile(activities=activities) as prof:
    start = time.perf_counter()
    for i in range(steps):
      torch_step_in_phases(trainer, batches[i % len(batches)])
    wall = (time.perf_counter() - start) / steps
  ops, cats, phases, op_cats = (collections.Counter() for _ in range(4))
  for e in prof.events():
    if e.name.startswith("phase:") or e.self_cpu_time_total <= 0:
      continue
    seconds = e.self_cpu_time_total * 1e-6 / steps
    phase = _torch_phase(e)
    category = torch_category(e.name, phase)
    ops[e.name] += seconds
    cats[category] += seconds
    phases[phase] += seconds
    op_cats[e.name, category] += seconds
  labels = {}  # each op's category: where most of its time went
  for (name, category), _ in sorted(op_cats.items(), key=lambda kv: kv[1]):
    labels[name] = category
  return {"ops": ops, "categories": cats, "phases": phases, "wall": wall, "labels": labels}


# ---------------------------------------------------------------------------------------------
# jaxtrain (XLA:CPU)

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def parse_hlo(text: str) -> tuple[dict, dict]:
  """The optimized HLO text -> (instruction name -> {opcode, op_name, calls, operands, sizes},
  computation name -> its instructions' names)."""
  instructions, computations, current = {}, {}, None
  for line in text.splitlines():
    if not line.startswith(" ") and "{" in line and (m := _COMPUTATION.match(line)):
      current = computations.setdefault(m.group(1), [])
      continue
    m = _INSTRUCTION.match(line)
    if not m or current is None:
      continue
    name, shape, opcode, rest = m.groups()
    calls = re.search(r"calls=%([\w.\-]+)", rest)
    target = re.search(r'custom_call_target="([^"]*)"', rest)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dims in _SHAPE.findall(shape)]
    instructions[name] = {"opcode": opcode, "calls": calls.group(1) if calls else None,
                          "operands": re.findall(r"%([\w.\-]+)", rest.split(")")[0]),
                          "target": target.group(1) if target else "",
                          "op_name": op_name.group(1) if op_name else "", "sizes": sizes}
    current.append(name)
  return instructions, computations


def _fused(name: str, instructions: dict, computations: dict) -> list[dict]:
  """The instruction and, for a fusion, every instruction of its fused computation."""
  inst = instructions[name]
  inner = computations.get(inst["calls"], []) if inst["opcode"] == "fusion" else []
  return [inst] + [instructions[n] for n in inner]


def hlo_category(name: str, instructions: dict, computations: dict, scores_size: int) -> str:
  """The category of one thunk-level instruction, first match: optimizer (clipping, AdamW, the
  step's norms) outside the model's jvp; copy/transpose if it only moves data; attention if it is
  the attention core (its ops say so, or it touches the [B, H, L, S] scores); matmul if it holds a
  dot; copy/transpose if it writes a transpose (XLA:CPU's loops transpose untiled: such a fusion
  costs ~20x the same one without); norm/elementwise inside the blocks; other."""
  ops = _fused(name, instructions, computations)
  op_name = instructions[name]["op_name"]
  opcodes = {o["opcode"] for o in ops} - {"fusion"}
  operands = [instructions[n] for n in instructions[name]["operands"] if n in instructions]
  if not any(k in op_name for k in ("jvp(", "/attn", "norm", "/mlp", "layers/")):
    return "optimizer"
  if opcodes <= HLO_LAYOUT:
    return "copy/transpose"
  core = any(k in o["op_name"] for o in ops for k in ATTENTION_CORE)
  if "/attn/" in op_name and (core or any(scores_size in o["sizes"] for o in ops + operands)):
    return "attention"
  if opcodes & {"dot", "convolution"} or "matmul" in instructions[name]["target"].lower():
    return "matmul"
  if "transpose" in opcodes:
    return "copy/transpose"
  if any(k in op_name for k in ("norm", "/mlp", "/attn", "layers/add")):
    return "norm/elementwise"
  return "other"


def hlo_phase(op_name: str) -> str:
  if "transpose(jvp(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  return "optimizer"


def _trace_events(directory: str):
  """(hlo_op, start ns, end ns) of every thunk event in the newest trace under `directory`."""
  paths = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs
           if f.endswith(".xplane.pb")]
  data = jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats:
          yield stats["hlo_op"], event.start_ns, event.start_ns + event.duration_ns


def wall_shares(intervals) -> dict:
  """Seconds of wall time per key from (key, start ns, end ns) intervals that may overlap (XLA:CPU's
  thunk executor runs independent thunks at once): while n run together each is charged 1/n."""
  edges = sorted([(start, 1, key) for key, start, _ in intervals] +
                 [(end, -1, key) for key, _, end in intervals], key=lambda e: (e[0], e[1]))
  active, charged, last = collections.Counter(), collections.Counter(), None
  for t, step, key in edges:
    if last is not None and active:
      n = sum(active.values())
      for k, count in active.items():
        charged[k] += (t - last) * count / n * 1e-9
    active[key] += step
    if not active[key]:
      del active[key]
    last = t
  return charged


def profile_jax(trainer, compiled, batches, steps: int, scores_size: int) -> dict:
  """Per-step wall seconds of each HLO instruction (overlapping thunks share their overlap),
  category and phase; the profiled step's wall time and the thunks' summed (thread) time.
  `compiled`: the AOT-compiled step whose HLO names the instructions the trainer runs."""
  instructions, computations = parse_hlo(compiled.as_text())
  with tempfile.TemporaryDirectory() as directory:
    jax.profiler.start_trace(directory)
    start = time.perf_counter()
    for i in range(steps):
      trainer.step(batches[i % len(batches)])
    wall = (time.perf_counter() - start) / steps
    jax.profiler.stop_trace()
    events = [e for e in _trace_events(directory)
              if e[0] in instructions and instructions[e[0]]["opcode"] not in HLO_CONTROL]
  ops, cats, phases = (collections.Counter() for _ in range(3))
  labels = {}
  for name, seconds in wall_shares(events).items():
    seconds /= steps
    op_name = instructions[name]["op_name"]
    label = _hlo_label(name, op_name)
    labels[label] = hlo_category(name, instructions, computations, scores_size)
    ops[label] += seconds
    cats[labels[label]] += seconds
    phases[hlo_phase(op_name)] += seconds
  thread = sum(end - start for _, start, end in events) * 1e-9 / steps
  return {"ops": ops, "categories": cats, "phases": phases, "wall": wall, "labels": labels,
          "thread_time": thread, "events": events}


def _hlo_label(name: str, op_name: str) -> str:
  """A readable key grouping an instruction with its kind in the other layers: the fusion's kind
  (name without its number) and the op_name's tail after the module path."""
  kind = re.sub(r"\.\d+$", "", name)
  where = re.sub(r"^jit\(\w+\)/", "", op_name)
  where = re.sub(r"closed_call/", "", where).replace("transpose(jvp(Transformer))", "bwd")
  where = where.replace("jvp(Transformer)", "fwd")
  return f"{kind} [{where}]"


# ---------------------------------------------------------------------------------------------
# matmul GFLOP/s


def matmul_shapes(cfg) -> list[tuple[int, int, int]]:
  """(M, K, N) of the step's matmuls: the projections' forward (and dx) shapes with M = tokens,
  and the weight gradients' with K = tokens."""
  m, n_tok = cfg.model, cfg.train.batch_size * cfg.train.seq_len
  d, f, v = m.d_model, m.d_ff, m.vocab_size
  return [(n_tok, d, d), (n_tok, d, f), (n_tok, f, d), (n_tok, d, v), (d, n_tok, f)]


def matmul_gflops(shapes, rounds: int) -> dict:
  """Median GFLOP/s of each (M, K, N) f32 matmul in torch and jax, interleaved."""
  import torch
  jdot = jax.jit(jnp.dot)
  rng = np.random.default_rng(0)
  out = {}
  for mkn in shapes:
    mm, kk, nn = mkn
    a, b = (rng.standard_normal(s, np.float32) for s in ((mm, kk), (kk, nn)))
    ta, tb, ja, jb = torch.from_numpy(a), torch.from_numpy(b), jnp.asarray(a), jnp.asarray(b)
    calls = {"torch": lambda ta=ta, tb=tb: torch.mm(ta, tb),
             "jax": lambda ja=ja, jb=jb: jdot(ja, jb).block_until_ready()}
    times = {k: [] for k in calls}
    for f in calls.values():  # warm up (compile)
      f()
    for _ in range(rounds):
      for k, f in calls.items():
        start = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - start)
    out[mkn] = {k: 2 * mm * kk * nn / statistics.median(ts) / 1e9 for k, ts in times.items()}
  return out


def matmul_flops_per_step(cfg) -> float:
  """Projection and head matmul FLOPs of one step (forward + both backward matmuls), the attention
  core's L x L products left out."""
  m = cfg.model
  per_layer = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff
  params = m.n_layers * per_layer + m.d_model * m.vocab_size
  return 6.0 * params * cfg.train.batch_size * cfg.train.seq_len


# ---------------------------------------------------------------------------------------------
# the report


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:,.0f} ms"


def category_table(results: dict, matmul_flops: float) -> str:
  """One row per category, a column pair (time, share) per framework; effective in-step matmul
  GFLOP/s last."""
  names = list(results)
  head = "| category | " + " | ".join(f"{n} ms/step | {n} share" for n in names) + " |"
  lines = [head, "|---|" + "---|---|" * len(names)]
  for key, label, rows in (("categories", "", CATEGORIES), ("phases", "phase: ", PHASES)):
    for row in rows:
      cells = [f"{_ms(results[n][key][row])} | "
               f"{results[n][key][row] / sum(results[n][key].values()):.0%}" for n in names]
      lines.append(f"| {label}{row} | " + " | ".join(cells) + " |")
  sums = {n: sum(results[n]["categories"].values()) for n in names}
  cells = [f"{_ms(sums[n])} | {sums[n] / results[n]['wall']:.0%} of wall" for n in names]
  lines.append("| sum of ops | " + " | ".join(cells) + " |")
  lines.append("| step wall (profiled) | " + " | ".join(
      f"{_ms(results[n]['wall'])} | " for n in names) + " |")
  lines.append("| in-step matmul GFLOP/s | " + " | ".join(
      f"{matmul_flops / results[n]['categories']['matmul'] / 1e9:.0f} | " for n in names) + " |")
  return "\n".join(lines)


def top_ops_table(name: str, result: dict, top: int) -> str:
  total = sum(result["ops"].values())
  lines = [f"| {name} op | category | ms/step | % of step wall | % of op time |",
           "|---|---|---|---|---|"]
  for op, seconds in result["ops"].most_common(top):
    lines.append(f"| `{op}` | {result['labels'][op]} | {seconds * 1e3:,.0f} | "
                 f"{seconds / result['wall']:.1%} | {seconds / total:.1%} |")
  return "\n".join(lines)


def matmul_table(gflops: dict) -> str:
  lines = ["| M x K x N (f32) | torch GFLOP/s | jax GFLOP/s | jax / torch |", "|---|---|---|---|"]
  for (m, k, n), g in gflops.items():
    lines.append(f"| {m} x {k} x {n} | {g['torch']:.0f} | {g['jax']:.0f} | "
                 f"{g['jax'] / g['torch']:.2f}x |")
  return "\n".join(lines)


def report(torch_trainer, jax_trainers, cfg, batches, steps: int, matmul_rounds: int) -> str:
  """The profile of torch eager and of each jax trainer (warmed up, `compiled` set), their tables
  and the matmul GFLOP/s, as Markdown."""
  m, t = cfg.model, cfg.train
  scores_size = t.batch_size * m.n_heads * t.seq_len * t.seq_len
  loads = [os.getloadavg()[0]]
  results = {"torch eager": profile_torch(torch_trainer, batches, steps)}
  loads.append(os.getloadavg()[0])
  for j in jax_trainers:
    results[j.name] = profile_jax(j, j.compiled, batches, steps, scores_size)
  loads.append(os.getloadavg()[0])
  gflops = matmul_gflops(matmul_shapes(cfg), matmul_rounds)
  loads.append(os.getloadavg()[0])
  thread = ", ".join(f"{j.name} {_ms(results[j.name]['thread_time'])} = "
                     f"{results[j.name]['thread_time'] / results[j.name]['wall']:.0%}"
                     for j in jax_trainers)
  parts = [
      (f"Profiled {steps} step(s) each; 1-minute load average before / after torch / after jax "
       f"/ after the matmuls: {' / '.join(f'{x:.1f}' for x in loads)}. torch: self-CPU time of "
       f"each op. jax: wall time of each XLA thunk, overlapping thunks sharing their overlap "
       f"(summed thread time, of the step wall: {thread})."),
      category_table(results, matmul_flops_per_step(cfg)),
      top_ops_table("torch eager", results["torch eager"], 12)]
  for j in jax_trainers:
    parts.append(top_ops_table(j.name, results[j.name], 16))
  parts.append("Matmul GFLOP/s, median of interleaved calls (M = tokens a step; the last row is a "
               "weight gradient, K = tokens):\n\n" + matmul_table(gflops))
  return "\n\n".join(parts)
