"""jaxtrain against PyTorch on this CPU: the same model trained side by side, tokens/s and ratios.

  python benchmarks/vs_torch.py [--rounds 7] [--steps 3] [--no_compile] [--record]

small_20m's model (d 512, 6 layers, 8 heads of 64, SwiGLU d_ff 1536, vocab 256, tied embeddings,
RoPE, RMSNorm), 16 x 256 tokens a step, float32, AdamW (b1 0.9, b2 0.95, weight decay 0.1 on
matrices) after global-norm clipping at 1.0, as small_20m trains. Three trainers: torch eager,
torch.compile (inductor) and jaxtrain's own train step (builder.compile_steps, one device: what the
loop runs, with its metrics; its attention masks by segment, torch's is plain causal). Each is
warmed up, then `rounds` rounds in which each runs `steps` steps in turn on the same batches, so
that load from other processes falls on all alike. Median step time -> tokens/s, and each one's
ratio to torch eager. torch is a bench-only dependency (`pip install -e ".[bench]"`; the test extra
has it too). `--record` appends the table to benchmarks/RESULTS.md.

  python benchmarks/vs_torch.py --profile [--profile_steps 1]
  python benchmarks/vs_torch.py --tries ynn_off,fused_gate_up [--rounds 5 --steps 1]

`--profile`: where the time goes, torch eager and jaxtrain per op and by category, and the matmul
GFLOP/s of each (vs_torch_profile.py), after a short interleaved timing. `--tries`: jaxtrain built
other ways (XLA options, config, patches: vs_torch_tries.TRIES), timed interleaved with torch eager
and the unchanged jaxtrain step.
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxtrain import builder, config_files, parallel  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402


def small_20m():
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", "small_20m.py"))
  cfg.mesh.update(data=1, fsdp=1, expert=1, tensor=1)
  return cfg


class Jaxtrain:
  """The loop's own train step of small_20m on one device; `step(tokens_BL)` returns once its
  metrics are on the host. With `compiler_options` (XLA debug options, {} for none) the step is
  compiled ahead of time with them, and `compiled` holds the executable (its HLO names the thunks
  of a profile)."""

  def __init__(self, cfg, name: str = "jaxtrain", compiler_options: dict | None = None):
    self.name, self.compiled = name, None
    mesh, task, tx, schedule = builder.build(cfg, "", jax.devices()[:1])
    self.state, shardings = state_lib.create_state(task, tx, cfg.train.seed, mesh, cfg.mesh.rules)
    self.feed = parallel.Feed(task.batch_size, parallel.batch_sharding(mesh))
    self.context = lambda: parallel.activate(mesh, cfg.mesh.rules)
    with self.context():
      self.train_fn, _ = builder.compile_steps(cfg, mesh, task, tx, schedule, shardings)
      if compiler_options is not None:
        rows = np.zeros((task.batch_size, cfg.train.seq_len + 1), np.int32)
        self.compiled = self.train_fn.lower(self.state, self.feed.put(lm_batch(rows))).compile(
            compiler_options)
        self.train_fn = self.compiled

  def step(self, tokens_BL) -> float:
    batch = self.feed.put(lm_batch(tokens_BL))
    with self.context():
      start = time.perf_counter()
      self.state, metrics = self.train_fn(self.state, batch)
      float(metrics["loss"])
      return time.perf_counter() - start


def lm_batch(tokens_BL) -> dict:
  """jaxtrain's language-model batch of whole rows (one document each)."""
  b, l = tokens_BL.shape
  inputs, targets = tokens_BL[:, :-1], tokens_BL[:, 1:]
  return {"inputs": inputs, "targets": targets, "segment_ids": np.ones((b, l - 1), np.int32),
          "positions": np.broadcast_to(np.arange(l - 1, dtype=np.int32), (b, l - 1)).copy(),
          "loss_mask": np.ones((b, l - 1), np.float32)}


class Torch:
  """The same decoder in torch, nanoGPT's way: pre-norm blocks, fused causal SDPA, AdamW."""

  def __init__(self, cfg, compiled: bool):
    import torch
    self.torch, self.name = torch, "torch.compile" if compiled else "torch eager"
    torch.manual_seed(0)
    self.model = _decoder(torch, cfg.model)
    m = cfg.model
    decay = [p for p in self.model.parameters() if p.ndim >= 2]
    rest = [p for p in self.model.parameters() if p.ndim < 2]
    o = cfg.optim
    self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, foreach=True)
    self.clip, self.vocab = o.grad_clip, m.vocab_size
    self.forward = torch.compile(self.model) if compiled else self.model

  def step(self, tokens_BL) -> float:
    torch = self.torch
    x = torch.from_numpy(np.ascontiguousarray(tokens_BL)).long()
    start = time.perf_counter()
    logits = self.forward(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), x[:, 1:].reshape(-1))
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.opt.step()
    float(loss.detach())
    return time.perf_counter() - start


def _decoder(torch, m):
  nn, F = torch.nn, torch.nn.functional
  half = m.head_dim // 2
  inv = 1.0 / (m.rope_theta ** (np.arange(half, dtype=np.float64) / half))
  angle = np.arange(m.max_seq_len)[:, None] * inv[None]
  cos_LK, sin_LK = (torch.tensor(f(angle), dtype=torch.float32) for f in (np.cos, np.sin))

  def rope(x_BHLK):
    cos, sin = cos_LK[:x_BHLK.shape[2]], sin_LK[:x_BHLK.shape[2]]
    a, b = x_BHLK[..., :half], x_BHLK[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.n1 = nn.RMSNorm(m.d_model, eps=m.norm_eps)
      self.n2 = nn.RMSNorm(m.d_model, eps=m.norm_eps)
      self.qkv = nn.Linear(m.d_model, 3 * m.n_heads * m.head_dim, bias=False)
      self.out = nn.Linear(m.n_heads * m.head_dim, m.d_model, bias=False)
      self.gate_up = nn.Linear(m.d_model, 2 * m.d_ff, bias=False)
      self.down = nn.Linear(m.d_ff, m.d_model, bias=False)

    def forward(self, x_BLD):
      b, l, _ = x_BLD.shape
      q, k, v = self.qkv(self.n1(x_BLD)).view(b, l, 3, m.n_heads, m.head_dim).permute(2, 0, 3, 1, 4)
      y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
      x_BLD = x_BLD + self.out(y.transpose(1, 2).reshape(b, l, -1))
      gate, up = self.gate_up(self.n2(x_BLD)).chunk(2, dim=-1)
      return x_BLD + self.down(F.silu(gate) * up)

  class Decoder(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(m.vocab_size, m.d_model)
      self.blocks = nn.ModuleList(Block() for _ in range(m.n_layers))
      self.norm = nn.RMSNorm(m.d_model, eps=m.norm_eps)

    def forward(self, tokens_BL):
      x_BLD = self.embed(tokens_BL)
      for block in self.blocks:
        x_BLD = block(x_BLD)
      return self.norm(x_BLD) @ self.embed.weight.T  # tied embeddings

  return Decoder()


def measure(trainers, batches, rounds: int, steps: int) -> dict:
  """Seconds of each step of each trainer over `rounds` interleaved rounds of `steps` steps."""
  times = {t.name: [] for t in trainers}
  for r in range(rounds):
    for t in trainers:
      for s in range(steps):
        times[t.name].append(t.step(batches[(r * steps + s) % len(batches)]))
  return times


def format_table(times: dict, tokens: int, extra: bool) -> str:
  """Median step, tokens/s and ratio to torch eager of each trainer; `extra`: also the ratio to
  jaxtrain and the fastest step (the least loaded one) with its ratio to torch eager's fastest."""
  median = {name: statistics.median(ts) for name, ts in times.items()}
  eager, base = median["torch eager"], median["jaxtrain"]
  lines = ["| trainer | step (median) | tokens/s | vs torch eager |", "|---|---|---|---|"]
  if extra:
    lines = [lines[0] + " vs jaxtrain | fastest step | fastest vs torch eager's |",
             lines[1] + "---|---|---|"]
  for name, seconds in median.items():
    lines.append(f"| {name} | {seconds * 1e3:.0f} ms | {tokens / seconds:,.0f} | "
                 f"{eager / seconds:.2f}x |")
    if extra:
      best = min(times[name])
      lines[-1] += (f" {base / seconds:.2f}x | {best * 1e3:.0f} ms | "
                    f"{min(times['torch eager']) / best:.2f}x |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, help="default 7 (--profile: 3)")
  parser.add_argument("--steps", type=int, help="steps per trainer per round: 3 (--profile: 1)")
  parser.add_argument("--warmup", type=int, help="default 3 (--profile: 2)")
  parser.add_argument("--no_compile", action="store_true", help="leave torch.compile out")
  parser.add_argument("--record", action="store_true",
                      help="append the table to benchmarks/RESULTS.md")
  parser.add_argument("--profile", action="store_true",
                      help="per-op profile of torch eager and jaxtrain (and --tries; leaves "
                      "torch.compile out)")
  parser.add_argument("--profile_steps", type=int, default=1, help="steps profiled per trainer")
  parser.add_argument("--tries", default="",
                      help="comma-separated vs_torch_tries.TRIES, each timed beside jaxtrain")
  args = parser.parse_args(argv)
  if args.tries:
    import vs_torch_tries
    unknown = set(args.tries.split(",")) - set(vs_torch_tries.TRIES)
    if unknown:
      parser.error(f"--tries: unknown {', '.join(sorted(unknown))}; choose from "
                   f"{', '.join(vs_torch_tries.TRIES)}")
  defaults = (3, 1, 2) if args.profile else (7, 3, 3)  # a profile run stays within minutes
  for key, value in zip(("rounds", "steps", "warmup"), defaults, strict=True):
    if getattr(args, key) is None:
      setattr(args, key, value)
  import torch
  cfg = small_20m()
  rng = np.random.default_rng(0)
  tokens = cfg.train.batch_size * cfg.train.seq_len  # rows of seq_len + 1: inputs, targets
  batches = [rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1),
                          dtype=np.int32) for _ in range(4)]
  load = os.getloadavg()
  trainers = [Torch(cfg, compiled=False)]
  trainers += [] if args.no_compile or args.profile or args.tries else [Torch(cfg, compiled=True)]
  trainers.append(Jaxtrain(cfg, compiler_options={} if args.profile else None))
  if args.tries:
    trainers += [vs_torch_tries.build(name, small_20m, Jaxtrain) for name in args.tries.split(",")]
  for t in trainers:  # compile and warm up each, outside the timed rounds
    for i in range(args.warmup):
      t.step(batches[i % len(batches)])
  times = measure(trainers, batches, args.rounds, args.steps)
  extra = bool(args.profile or args.tries)
  table = format_table(times, tokens, extra)
  if extra:
    table += (f"\n\n1-minute load average {load[0]:.1f} before building, "
              f"{os.getloadavg()[0]:.1f} after timing; {args.rounds} rounds x {args.steps} steps, "
              f"interleaved, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores.")
  print(table)
  if args.profile:
    import vs_torch_profile
    jax_trainers = [t for t in trainers if isinstance(t, Jaxtrain)]
    print("\n" + vs_torch_profile.report(trainers[0], jax_trainers, cfg, batches,
                                         args.profile_steps, matmul_rounds=5))
  if args.record:
    cmd = "python benchmarks/vs_torch.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write(f"\n## jaxtrain vs PyTorch on CPU, small_20m ({datetime.date.today()})\n\n"
              f"`{cmd.strip()}`: {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, jax {jax.__version__}, torch {torch.__version__}, "
              f"{args.rounds} rounds x {args.steps} steps each, interleaved; {tokens} tokens a "
              f"step.\n\n{table}\n")


if __name__ == "__main__":
  main()
