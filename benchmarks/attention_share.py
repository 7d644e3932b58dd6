"""What limits the CPU train step: the same step with the softmax-attention core removed.

  python benchmarks/attention_share.py [--config small_20m] [--steps 5]

Replaces `dot_product_attention` by a pass-through of the queries (same projections, no L x L
scores, no softmax) and times both steps side by side; the difference is attention's cost."""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step  # noqa: E402

from jaxtrain.model import attention  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="small_20m")
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  full = train_step.time_config(args.config, args.steps)
  original = attention.dot_product_attention
  attention.dot_product_attention = lambda q, k, v, mask: q
  try:
    without = train_step.time_config(args.config, args.steps)
  finally:
    attention.dot_product_attention = original
  share = 1 - without["step_time_s"] / full["step_time_s"]
  print(f"{args.config}: step {full['step_time_s'] * 1e3:.0f} ms, without the attention core "
        f"{without['step_time_s'] * 1e3:.0f} ms: attention core = {share:.0%} of the step")


if __name__ == "__main__":
  main()
