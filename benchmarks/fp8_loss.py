"""Loss of fp8 matmuls (model.fp8=current) against bf16 (model.fp8=off) on small_20m, same seed and data.

  python benchmarks/fp8_loss.py [--steps 40] [--batch_size 4] [--seq_len 256] [--workdir DIR]
                                [--config small_20m]

Both runs: compute_dtype bfloat16 (f32 master weights), one device, checkpoints only at the end. Prints
each run's final loss, the max and mean absolute per-step loss difference and the median step-time ratio
(on XLA:CPU fp8 dots are emulated by converts to f32: the ratio says nothing about fp8 hardware), as a
markdown section for benchmarks/RESULTS.md. `--config` runs another config of configs/ the same way
(a GPU's fp8 GEMMs pay off at wider matmuls than small_20m's).
"""

import argparse
import os
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jaxtrain  # noqa: E402
from benchmarks.train_step import machine_lines  # noqa: E402
from jaxtrain import config_files, metrics  # noqa: E402


def run(mode: str, args, workdir: str) -> dict:
  cfg = config_files.load_config_file(os.path.join(ROOT, "configs", f"{args.config}.py"))
  cfg.model.update(compute_dtype="bfloat16", fp8=mode)
  cfg.train.update(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, log_every=1, eval_every=0)
  cfg.optim.update(warmup_steps=min(cfg.optim.warmup_steps, args.steps // 4))
  cfg.mesh.update(data=1)
  jaxtrain.train(cfg, workdir, devices=jax.devices()[:1], progress=False)
  rows = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  return {"loss": np.array([r["loss"] for r in rows]), "time": np.array([r["step_time_s"] for r in rows])}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--workdir", default="", help="keeps the two runs' workdirs here (default: a temporary dir)")
  p.add_argument("--config", default="small_20m", help="a config of configs/ (default small_20m)")
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    base = args.workdir or tmp
    off, on = (run(mode, args, os.path.join(base, f"fp8_{mode}")) for mode in ("off", "current"))
  diff = np.abs(on["loss"] - off["loss"])
  late = slice(2, None)  # step times after compilation and warm-up
  ratio = np.median(on["time"][late]) / np.median(off["time"][late])
  print("\n".join(machine_lines()) + ", 1 device")
  config = f" --config {args.config}" if args.config != "small_20m" else ""
  print(f"- command: `python benchmarks/fp8_loss.py --steps {args.steps} --batch_size {args.batch_size} "
        f"--seq_len {args.seq_len}{config}`")
  print(f"- {args.config}, compute_dtype bfloat16, batch {args.batch_size} x {args.seq_len}, "
        f"{args.steps} steps, same seed and data\n")
  print("| model.fp8 | first loss | final loss | median step |")
  print("|---|---|---|---|")
  for name, r in (("off (bf16)", off), ("current (fp8)", on)):
    print(f"| {name} | {r['loss'][0]:.4f} | {r['loss'][-1]:.4f} | {np.median(r['time'][late]) * 1e3:.0f} ms |")
  print(f"\nper-step |loss(fp8) - loss(bf16)|: max {diff.max():.4f} (step {int(diff.argmax()) + 1}), "
        f"mean {diff.mean():.4f}, last 10 steps mean {diff[-10:].mean():.4f}; final difference "
        f"{on['loss'][-1] - off['loss'][-1]:+.4f}; step time fp8 / bf16 {ratio:.2f}x")
  print("losses off:", " ".join(f"{v:.3f}" for v in off["loss"]))
  print("losses fp8:", " ".join(f"{v:.3f}" for v in on["loss"]))


if __name__ == "__main__":
  main()
