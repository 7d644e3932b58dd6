"""`python -m jaxtrain eval`: task files scored by a workdir's or HF directory's model; a line per
task metric, and eval_results.json in the workdir (or --out). No jax import until it runs."""

import json
import os

from jaxtrain import config as config_lib

RESULTS = "eval_results.json"


def add_parser(sub) -> None:
  """The eval subcommand on the CLI's subparsers."""
  p = sub.add_parser("eval", help="score task files (JSONL: multiple_choice, perplexity) with a "
                                  "workdir's newest checkpoint or a HF directory")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir",
                      help="a training or converted workdir (writes eval_results.json)")
  source.add_argument("--from_hf", metavar="HF_DIR",
                      help="a HF Llama or Mixtral directory with its tokenizer (prints only)")
  p.add_argument("--tasks", required=True, metavar="A.jsonl,B.jsonl",
                 help="comma-separated task files")
  p.add_argument("--limit", type=int, default=None, metavar="N", help="the first N docs of each")
  p.add_argument("--num_fewshot", type=int, default=None, metavar="K",
                 help="solved examples before each doc (default: each task's own, a task "
                      "YAML's num_fewshot, else 0)")
  p.add_argument("--seed", type=int, default=0, help="the few-shot draw's seed")
  p.add_argument("--out", default=None, metavar="FILE",
                 help=f"write the results here (default: WORKDIR/{RESULTS}; none for --from_hf)")


def run(args) -> int:
  """Evaluates, prints `task metric value` lines, writes the results file; ConfigError is the
  caller's one line and exit status 2."""
  paths = [p for p in args.tasks.split(",") if p]
  if not paths:
    raise config_lib.ConfigError("--tasks: no task files given")
  from jaxtrain.eval import harness
  source = args.workdir or args.from_hf
  results = harness.evaluate(source, paths, num_fewshot=args.num_fewshot, seed=args.seed,
                             limit=args.limit)
  for task, metrics in results.items():
    for key, value in metrics.items():
      print(f"{task} {key} {value:.6g}" if isinstance(value, float) else f"{task} {key} {value}")
  out = args.out or (os.path.join(args.workdir, RESULTS) if args.workdir else None)
  if out:
    record = {"source": os.path.abspath(source), "tasks": [os.path.abspath(p) for p in paths],
              "num_fewshot": args.num_fewshot, "seed": args.seed, "limit": args.limit,
              "results": results}
    with open(out, "w") as f:
      json.dump(record, f, indent=1)
  return 0
