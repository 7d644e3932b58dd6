"""CLI: python -m jaxtrain {train,sample} ... Parses flags, loads the config, calls the library.

Bad flags and bad values end with one line on stderr and exit status 2."""

import argparse
import sys

from jaxtrain import config as config_lib


class _Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag as one line (exit status 2), without the usage block."""

  def error(self, message):
    raise config_lib.ConfigError(message)


def parse(argv):
  """Known flags via argparse; `--config.a.b=V` collected as overrides."""
  overrides, rest = {}, []
  for arg in argv:
    if arg.startswith("--config.") and "=" in arg:
      key, value = arg[len("--config."):].split("=", 1)
      overrides[key] = value
    elif arg.startswith("--config."):
      raise config_lib.ConfigError(f"{arg}: expected --config.KEY=VALUE")
    else:
      rest.append(arg)
  parser = _Parser(prog="python -m jaxtrain")
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="train a config in a workdir (resumes when it holds a checkpoint)")
  train.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  train.add_argument("--workdir", required=True)
  train.add_argument("--no_sample", action="store_true", help="skip the sample printed after training")
  train.add_argument("--start_over", action="store_true",
                     help="delete the workdir's checkpoints and start again (needed when the config changed)")
  train.add_argument("--distributed", action="store_true",
                     help="multi-host: call jax.distributed.initialize() (cluster auto-detection or "
                          "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
  prepare = sub.add_parser("prepare", help="tokenize a corpus once into the cache that training reads")
  prepare.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  prepare.add_argument("--workdir", required=True)
  sample = sub.add_parser("sample", help="continue a prompt with a trained model")
  sample.add_argument("--workdir", required=True)
  sample.add_argument("--prompt", default=None, help="defaults to the config's sample.prompt")
  sample.add_argument("--max_new_tokens", type=int, default=None)
  sample.add_argument("--temperature", type=float, default=None)
  sample.add_argument("--top_k", type=int, default=None)
  sample.add_argument("--seed", type=int, default=0)
  return parser.parse_args(rest), overrides


def _prepare(cfg, workdir: str) -> int:
  from jaxtrain import data
  if cfg.data.kind != "text":
    raise config_lib.ConfigError(f"prepare: data.kind={cfg.data.kind!r} needs no preparation (only 'text')")
  try:
    data.prepare_corpus(cfg, workdir)
  except (FileNotFoundError, ValueError) as e:  # DataError is a ValueError
    raise config_lib.ConfigError(str(e)) from e
  return 0


def main(argv=None) -> int:
  try:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    if args.command in ("train", "prepare"):
      cfg = config_lib.apply_overrides(config_lib.load_config_file(args.config), overrides)
      import jax  # after flag parsing, so that --help and bad flags stay fast
      if getattr(args, "distributed", False):
        jax.distributed.initialize()
      config_lib.validate(cfg, jax.device_count())
    elif overrides:
      raise config_lib.ConfigError("--config.* overrides apply to train and prepare only")
    if args.command == "prepare":
      return _prepare(cfg, args.workdir)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  import jaxtrain
  if args.command == "train":
    try:
      final = jaxtrain.train(cfg, args.workdir, start_over=args.start_over)
    except config_lib.ConfigError as e:  # data paths and contents, checked before compiling
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(final.items())))
    if final.get("preempted"):
      from jaxtrain.train.preemption import EXIT_STATUS
      print(f"preempted ({final['preempted']}) at step {final['step']}: checkpoint saved; rerun the same "
            "command to resume", file=sys.stderr)
      return EXIT_STATUS
    if not args.no_sample and jax.process_index() == 0:
      s = cfg.sample
      text = jaxtrain.sample(args.workdir, s.prompt, s.max_new_tokens, s.temperature, s.top_k)
      print(f"sample: {s.prompt!r} -> {text!r}")
    return 0

  try:
    from jaxtrain.train import load_config
    s = load_config(args.workdir).sample
    prompt = s.prompt if args.prompt is None else args.prompt
    text = jaxtrain.sample(args.workdir, prompt,
                           s.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
                           s.temperature if args.temperature is None else args.temperature,
                           s.top_k if args.top_k is None else args.top_k, seed=args.seed)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
