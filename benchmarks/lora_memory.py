"""LoRA against full fine-tuning on one config: the bytes a checkpoint's state holds (the state dict
Checkpoints.save writes) and the compiled train step's memory per device (XLA memory_analysis on this
host's devices; compiled, not run). Nothing is trained: `checkpoint.init_from` only names a base.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/lora_memory.py [--config configs/small_20m.py]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.serialization  # noqa: E402
import jax  # noqa: E402

from jaxtrain import builder, config_files  # noqa: E402
from jaxtrain.core import state as state_lib  # noqa: E402
from jaxtrain.plan import compiled  # noqa: E402

VARIANTS = (("full fine-tuning", {}),
            ("LoRA rank 8, attention q and v", {"model.lora_rank": "8"}),
            ("LoRA rank 8, every weight", {"model.lora_rank": "8", "model.lora_targets": ".*"}),
            ("LoRA rank 8, every weight, int8 base", {"model.lora_rank": "8",
                                                      "model.lora_targets": ".*",
                                                      "model.lora_base_bits": "8"}))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/small_20m.py")
  a = p.parse_args(argv)
  mib = lambda n: f"{n / 2**20:.2f}"
  print(f"{a.config}, jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}")
  print("| variant | checkpointed state MiB | step arguments MiB | temporaries MiB | total MiB |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for label, over in VARIANTS:
    if over:
      over = {**over, "checkpoint.init_from": "runs/base"}
    cfg = config_files.apply_overrides(config_files.load_config_file(a.config), over)
    run = builder.build(cfg, "")
    tree = flax.serialization.to_state_dict(state_lib.abstract_state(run.task, run.tx))
    saved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    m = compiled.compiled_memory(cfg)
    print(f"| {label} | {mib(saved)} | {mib(m['argument'])} | {mib(m['temp'])} | {mib(m['total'])} |",
          flush=True)


if __name__ == "__main__":
  main()
