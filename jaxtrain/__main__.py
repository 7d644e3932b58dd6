"""CLI: python -m jaxtrain {train,launch,prepare,sample,convert,inspect,comm,plan,compile,eval} ...
Parses flags, loads the config, calls the library.

Bad flags and bad values end with one line on stderr and exit status 2."""

import argparse
import os
import sys

from jaxtrain import config as config_lib, config_files, errors
from jaxtrain.eval import cli as eval_cli
from jaxtrain.plan import devices as plan_devices


class _Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag as one line (exit status 2), without the usage block."""

  def error(self, message):
    raise config_lib.ConfigError(message)


def _exit_statuses() -> str:
  """The statuses a run ends with, as jaxtrain/errors.py documents them."""
  return "exit status:\n" + "\n".join(line for line in errors.__doc__.splitlines()
                                      if line[:3].strip().isdigit() or line.startswith("     "))


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
  train = sub.add_parser("train",
                         help="train a config in a workdir (resumes when it holds a checkpoint)",
                         epilog=_exit_statuses(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
  train.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  train.add_argument("--workdir", required=True)
  train.add_argument("--no_sample", action="store_true",
                     help="skip the sample printed after training")
  train.add_argument(
      "--start_over", action="store_true",
      help="delete the workdir's checkpoints and start again (needed when the config changed)")
  train.add_argument("--distributed", action="store_true",
                     help="multi-process: join jax.distributed first; each of the four flags "
                          "below, else its variable JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                          "JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS, else cluster auto-detection "
                          "(Slurm, Open MPI, TPU)")
  train.add_argument("--coordinator_address", metavar="HOST:PORT",
                     help="with --distributed: process 0's address")
  train.add_argument("--num_processes", type=int, metavar="N",
                     help="with --distributed: processes in the run")
  train.add_argument("--process_id", type=int, metavar="I",
                     help="with --distributed: this process, 0..N-1")
  train.add_argument("--local_device_ids", metavar="IDS",
                     help="with --distributed: this process's devices, e.g. 0,1")
  prepare = sub.add_parser("prepare",
                           help="tokenize a corpus once into the cache that training reads")
  prepare.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  prepare.add_argument("--workdir", required=True)
  sample = sub.add_parser("sample", help="continue a prompt with a trained model (a masked LM: "
                          "fill in its [MASK] markers; a vlm run: answer about --image)")
  sample.add_argument("--workdir", required=True)
  sample.add_argument("--prompt", default=None, help="defaults to the config's sample.prompt")
  sample.add_argument("--max_new_tokens", type=int, default=None)
  sample.add_argument("--temperature", type=float, default=None)
  sample.add_argument("--top_k", type=int, default=None)
  sample.add_argument("--seed", type=int, default=0)
  sample.add_argument("--image", default=None, metavar="PATH",
                      help="a vlm run: the PNG or JPEG file to answer about (the prompt defaults to "
                           "'shape?' on the shapes data, to none on image-text pairs)")
  convert = sub.add_parser(
      "convert",
      help="HF Llama/Mixtral/BERT safetensors <-> jaxtrain checkpoint, streamed leaf by leaf")
  convert.add_argument("--from_hf", metavar="HF_DIR",
                       help="a HF Llama, Mixtral or BertForMaskedLM directory (config.json + "
                       "*.safetensors)")
  convert.add_argument("--to", metavar="WORKDIR",
                       help="with --from_hf: the workdir to create (config.json, checkpoints/0)")
  convert.add_argument("--from", dest="from_dir", metavar="DIR",
                       help="a workdir or checkpoint tier directory")
  convert.add_argument("--to_hf", metavar="OUT_DIR", help="with --from: the HF directory to write")
  convert.add_argument("--step", type=int, default=None, metavar="N",
                       help="with --from: the step (default: the newest)")
  convert.add_argument("--dtype", choices=config_lib.DTYPES, default="float32",
                       help="dtype of the written weights")
  inspect = sub.add_parser("inspect",
                           help="a workdir's or tier's checkpoints, one step's tree and config")
  inspect.add_argument("dir", help="a workdir or checkpoint tier directory")
  inspect.add_argument("--step", type=int, default=None, metavar="N",
                       help="the step to describe (default: the newest)")
  comm = sub.add_parser("comm", help="bytes each device sends per optimizer step, by mesh axis and "
                                     "dtype, counted in the compiled train step, against the "
                                     "float32 data-parallel baseline")
  comm.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  comm.add_argument(
      "--project", action="store_true",
      help="also a projected (modelled, not measured) utilization on 1/10/100 Gbit/s links")
  comm.add_argument("--target", default=None, metavar="KIND:SHAPE",
                    help="compile for a TPU slice or GPUs (as compile takes them) and split the "
                         "bytes into those that overlap compute in its schedule and those exposed; "
                         "the projection then hides only what the schedule overlaps")
  plan = sub.add_parser("plan", help="predict per-device memory and step time of a config on a "
                                     "mesh, before any run (nothing compiled, no devices needed)")
  plan.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  plan.add_argument("--devices", type=int, default=None, metavar="N",
                    help="default: this machine's device count")
  plan.add_argument("--device_kind", choices=plan_devices.KINDS, default=None,
                    help="default: this machine's")
  plan.add_argument(
      "--device_memory_gib", type=float, default=None, metavar="G",
      help="per-device memory (default: train.device_memory_gib if set, else the device kind's)")
  plan.add_argument("--target", default=None, metavar="KIND:SHAPE",
                    help="plan for a TPU slice or GPUs (as compile takes them): sets --devices "
                         "and --device_kind")
  plan.add_argument("--compiled", action="store_true",
                    help="also compile the step (for --target, else on this machine's devices) "
                         "and print the compiler's per-device memory beside the prediction")
  compile_ = sub.add_parser(
      "compile", help="compile a config's train step for a TPU slice or GPUs this host does not "
                      "have (needs the tpu or cuda extra): per-device memory against HBM, "
                      "FLOPs, collective bytes by mesh axis; compiled, not executed")
  compile_.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  compile_.add_argument("--target", required=True, metavar="KIND:SHAPE",
                        help="tpu-v5p:4x4x4, tpu-v5e:16x16, tpu-v6e:8x8, h100:8, h200:8")
  eval_cli.add_parser(sub)
  # parsed by jaxtrain/launch.py (main() hands it over before this parser sees `-- train ...`)
  sub.add_parser("launch", add_help=False,
                 help="the N processes of a multi-process run on this host, restarted from the "
                      "newest checkpoint when one dies: launch --processes N [--max_restarts K] "
                      "[--min_processes M] -- train ...")
  return parser.parse_args(rest), overrides


# the commands that take --config and --config.* overrides
CONFIG_COMMANDS = ("train", "prepare", "comm", "plan", "compile")
DISTRIBUTED_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS",
                   "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID",
                   "local_device_ids": "JAX_LOCAL_DEVICE_IDS"}


def distributed_options(args, environ) -> dict | None:
  """jax.distributed.initialize's arguments for `train --distributed` (None without it): each flag,
  else its JAX_* variable; what neither gives is left to jax's cluster auto-detection."""
  if not getattr(args, "distributed", False):
    if any(getattr(args, key, None) is not None for key in DISTRIBUTED_ENV):
      raise config_lib.ConfigError(
          "--coordinator_address, --num_processes, --process_id and --local_device_ids "
          "need --distributed")
    return None
  options = {}
  for key, variable in DISTRIBUTED_ENV.items():
    flag = getattr(args, key)
    if flag is not None or environ.get(variable):
      options[key] = _distributed_value(key, flag, f"--{key}" if flag is not None else variable,
                                        environ.get(variable))
  n, i = options.get("num_processes"), options.get("process_id")
  if n is not None and n < 1:
    raise config_lib.ConfigError(f"--num_processes={n} must be positive")
  if n is not None and i is not None and not 0 <= i < n:
    raise config_lib.ConfigError(f"--process_id={i} must be in [0, {n})")
  return options


def _distributed_value(key: str, flag, source: str, variable: str | None):
  """One option from its flag (already typed by argparse, except the ids) or its variable's text."""
  text = str(flag) if flag is not None else variable
  if key == "coordinator_address":
    if not text.rpartition(":")[2].isdigit():
      raise config_lib.ConfigError(f"{source}={text!r}: expected HOST:PORT")
    return text
  if key == "local_device_ids":
    if not all(part.strip().isdigit() for part in text.split(",")):
      raise config_lib.ConfigError(f"{source}={text!r}: expected integers like 0,1")
    return [int(part) for part in text.split(",")]
  try:
    return int(text)
  except ValueError:
    raise config_lib.ConfigError(f"{source}={text!r}: expected an integer") from None


def _join(options: dict):
  """jax.distributed.initialize with `options`;
  what is missing and no cluster supplied is one line."""
  import jax
  try:
    jax.distributed.initialize(**options)
  except (ValueError, TypeError) as e:  # jax's own checks, after its cluster auto-detection
    missing = [f"--{key} (or {DISTRIBUTED_ENV[key]})"
               for key in ("coordinator_address", "num_processes", "process_id")
               if key not in options]
    if not missing:
      raise config_lib.ConfigError(f"--distributed: {e}") from e
    raise config_lib.ConfigError(
        f"--distributed: {' and '.join(missing)} not given, and no cluster (Slurm, Open "
        f"MPI, TPU) was detected to supply {'it' if len(missing) == 1 else 'them'}") from e


def _convert(args) -> int:
  if bool(args.from_hf) == bool(args.from_dir) or bool(args.from_hf) != bool(args.to) \
      or bool(args.from_dir) != bool(args.to_hf):
    raise config_lib.ConfigError(
        "convert: give either --from_hf DIR --to WORKDIR or --from DIR --to_hf OUT_DIR")
  if args.from_hf and args.step is not None:
    raise config_lib.ConfigError("convert: --step applies to --from only")
  from jaxtrain.checkpoint import convert
  if args.from_hf:
    print(f"wrote {convert.from_hf(args.from_hf, args.to, args.dtype)}")
  else:
    print(f"wrote {convert.to_hf(args.from_dir, args.to_hf, args.step, args.dtype)}")
  return 0


def _prepare(cfg, workdir: str) -> int:
  import jax
  from jaxtrain import data
  config_lib.validate(cfg, jax.device_count())
  if cfg.data.kind != "text":
    raise config_lib.ConfigError(
        f"prepare: data.kind={cfg.data.kind!r} needs no preparation (only 'text')")
  try:
    data.prepare_corpus(cfg, workdir)
  except (FileNotFoundError, ValueError) as e:  # DataError is a ValueError
    raise config_lib.ConfigError(str(e)) from e
  return 0


def _plan(cfg, args) -> int:
  """Prints the planner's table for `cfg` (train.batch_size/microbatches=auto:
  the planner's choice first)."""
  if args.target:
    from jaxtrain.aot import targets
    target = targets.parse(args.target)
    args.device_kind, args.devices = target.kind, target.n_devices
  if args.device_kind:
    # planning for named devices: leave accelerators alone
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.device_memory_gib is not None and args.device_memory_gib <= 0:
    raise config_lib.ConfigError(
        f"--device_memory_gib must be positive, got {args.device_memory_gib}")
  import jax
  from jaxtrain.plan import auto, predict
  n = jax.device_count() if args.devices is None else args.devices
  kind = args.device_kind or plan_devices.detect()
  gib = args.device_memory_gib or cfg.train.device_memory_gib
  limit = gib * 2**30 if gib else plan_devices.memory_bytes(kind, n)
  if config_lib.AUTO in (cfg.train.batch_size, cfg.train.microbatches):
    if n < 1:
      raise config_lib.ConfigError(f"--devices must be >= 1, got {n}")
    choice = auto.choose(cfg, n, kind, limit)
    cfg = auto.with_train(cfg, batch_size=choice["batch_size"], microbatches=choice["microbatches"])
    print(f"auto (predicted, not compiled): train.batch_size={choice['batch_size']} "
          f"train.microbatches={choice['microbatches']}")
  prediction = predict(cfg, n, kind, limit)
  print(prediction.table())
  if cfg.train.task == "vlm":
    from jaxtrain.model.vision import vision_param_count
    vision = vision_param_count(config_lib.ModelConfig.from_config(cfg.model),
                                config_lib.VisionConfig.from_config(cfg.model.vision))
    print(f"note: train.task=vlm: the prediction is the decoder's alone; the image encoder and "
          f"projector ({vision:,} parameters) and their activations are not in it (--compiled "
          "compiles the whole step)")
  if args.compiled:
    print(_compiled_line(cfg, args.target, prediction.memory["total"]))
  return 0


def _compiled_line(cfg, target, predicted: float) -> str:
  """The compiler's per-device total for `cfg` (on `target`, else this machine's devices) beside
  the prediction."""
  if target:
    from jaxtrain.aot import compile_for
    report = compile_for(cfg, target)
    if report.refusal:
      return f"compiled (XLA, {target}): refused: {report.refusal}"
    total, where = report.memory["total"], target
  else:
    from jaxtrain.plan.compiled import compiled_memory
    total, where = compiled_memory(cfg)["total"], "this machine"
  return (f"compiled (XLA, {where}): {total / 2**30:.2f} GiB per device; "
          f"predicted / compiled = {predicted / total:.3f}")


def _compile(cfg, args) -> int:
  """Prints what the target's compiler says of `cfg`'s train step; exit status 1 if it does not
  fit."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the target's devices are deviceless; leave ours
  from jaxtrain.aot import compile_for
  name = os.path.splitext(os.path.basename(args.config.split(":")[0]))[0]
  report = compile_for(cfg, args.target, name)
  print(report.table())
  return 0 if report.fits else 1


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["launch"]:
    from jaxtrain import launch
    return launch.main(argv[1:])
  try:
    args, overrides = parse(argv)
    if args.command in CONFIG_COMMANDS:
      cfg = config_files.apply_overrides(config_files.load_config_file(args.config), overrides)
      if args.command == "plan":
        return _plan(cfg, args)
      if args.command == "compile":
        return _compile(cfg, args)
      distributed = distributed_options(args, os.environ)
      import jax  # after flag parsing, so that --help and bad flags stay fast
      # jax's own heartbeat timeout after jaxtrain's (train/peers.py), for a clean line
      if distributed is not None:
        heartbeat = int(max(100, 2 * cfg.train.peer_timeout_s))
        _join({**distributed, "heartbeat_timeout_seconds": heartbeat})
      # validated once, by the library call each command makes (train, comm) or by _prepare
    elif overrides:
      raise config_lib.ConfigError(
          f"--config.* overrides apply to {', '.join(CONFIG_COMMANDS)} only")
    if args.command == "eval":
      return eval_cli.run(args)
    if args.command == "prepare":
      return _prepare(cfg, args.workdir)
    if args.command == "comm":
      from jaxtrain.train import comm
      print(comm.run(cfg, projection=args.project, target=args.target))
      return 0
    if args.command in ("convert", "inspect"):
      os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host-side work: leave accelerators alone
      if args.command == "convert":
        return _convert(args)
      from jaxtrain.checkpoint import convert
      print(convert.describe(args.dir, args.step))
      return 0
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
    # diverged, checkpoints unwritable, ...: one line and its own status
    except errors.RunError as e:
      print(f"error: {e}", file=sys.stderr)
      return e.exit_status
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in sorted(final.items())))
    if final.get("preempted"):
      from jaxtrain.train.preemption import EXIT_STATUS
      print(f"preempted ({final['preempted']}) at step {final['step']}: checkpoint saved; "
            "rerun the same command to resume", file=sys.stderr)
      return EXIT_STATUS
    # a reward model scores text; a vlm run answers about an image (sample --image PATH)
    if not args.no_sample and cfg.train.task not in ("rm", "vlm") and jax.process_index() == 0:
      s = cfg.sample
      text = jaxtrain.sample(args.workdir, s.prompt, s.max_new_tokens, s.temperature, s.top_k)
      print(f"sample: {s.prompt!r} -> {text!r}")
    return 0

  try:
    from jaxtrain.train import load_config
    saved = load_config(args.workdir)
    s = saved.sample
    prompt = args.prompt if args.prompt is not None else (
        None if saved.train.task == "vlm" else s.prompt)  # a vlm run's default is its data's
    text = jaxtrain.sample(args.workdir, prompt,
                           s.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
                           s.temperature if args.temperature is None else args.temperature,
                           s.top_k if args.top_k is None else args.top_k, seed=args.seed,
                           image=args.image)
  except config_lib.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
