"""Peak host memory of `convert` (HF -> jaxtrain, jaxtrain -> HF) against the largest tensor.

  python benchmarks/convert_memory.py [--layers 8] [--d_model 1024] [--d_ff 2816] [--vocab 16384] [--repeats 2]

Writes a random Llama-family HF checkpoint (numpy + safetensors, several hundred MB, f32) to a temp
dir, then runs in fresh subprocesses, each measured by its own peak RSS (VmHWM of /proc/self/status,
read by the child at exit: a child's ru_maxrss can include the parent's high-water mark, since
fork/vfork shares the parent's memory until exec):
  baseline   python that only imports jaxtrain's converter, jax and orbax and starts the CPU backend
  shapes     baseline + hf.leaf_plan (jax.eval_shape of the model's init): a fixed cost of both directions
  import     python -m jaxtrain convert --from_hf HF --to WORKDIR
  export     python -m jaxtrain convert --from WORKDIR --to_hf OUT
  reference  jaxtrain.checkpoint.hf.import_hf(HF): the whole model in memory at once (what streaming avoids)
Extra = peak - baseline, compared with the largest jaxtrain leaf (a stacked [layers, ...] array) and
with the model. Medians over `repeats`; the machine is shared, so ratios, not times, are the result.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.train_step import cpu_name  # noqa: E402 (children measure themselves: the parent may import jax)

BASELINE = "from jaxtrain.checkpoint import convert, hf; import orbax.checkpoint; import jax; jax.devices()"
SHAPES = BASELINE + "; import sys; hf.leaf_plan(hf.read_config(sys.argv[1]))"
REFERENCE = "import sys; from jaxtrain.checkpoint import hf; hf.import_hf(sys.argv[1])"
CHILD = """
import atexit, runpy, sys
def report():
  with open("/proc/self/status") as f:
    sys.stderr.write("\\nPEAK_KIB " + next(l for l in f if l.startswith("VmHWM:")).split()[1] + "\\n")
atexit.register(report)  # registered first, so it runs last
what, sys.argv = sys.argv[1], sys.argv[1:]
if what == "-m":
  sys.argv = sys.argv[1:]
  runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
  exec(what)
"""


def write_hf(path: str, layers: int, d: int, d_ff: int, vocab: int, heads: int, kv_heads: int) -> dict:
  """A random HF Llama checkpoint in two shards with an index; returns sizes in bytes."""
  head_dim = d // heads
  shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
  per_layer = {"self_attn.q_proj": (heads * head_dim, d), "self_attn.k_proj": (kv_heads * head_dim, d),
               "self_attn.v_proj": (kv_heads * head_dim, d), "self_attn.o_proj": (d, heads * head_dim),
               "mlp.gate_proj": (d_ff, d), "mlp.up_proj": (d_ff, d), "mlp.down_proj": (d, d_ff),
               "input_layernorm": (d,), "post_attention_layernorm": (d,)}
  for i in range(layers):
    shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in per_layer.items()})
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
               "hidden_size": d, "intermediate_size": d_ff, "num_hidden_layers": layers,
               "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
               "max_position_embeddings": 2048, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False, "torch_dtype": "float32"}, f)
  rng = np.random.default_rng(0)
  names = list(shapes)
  halves = [names[: len(names) // 2], names[len(names) // 2:]]
  weight_map = {}
  for i, half in enumerate(halves):
    fname = f"model-{i + 1:05d}-of-00002.safetensors"
    save_file({n: rng.standard_normal(shapes[n], np.float32) for n in half}, os.path.join(path, fname))
    weight_map.update({n: fname for n in half})
  total = sum(4 * int(np.prod(s)) for s in shapes.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  largest_leaf = max([4 * vocab * d] + [4 * layers * int(np.prod(s)) for s in per_layer.values()])
  return {"model": total, "largest_leaf": largest_leaf, "largest_hf": max(4 * int(np.prod(s)) for s in shapes.values())}


def peak_rss(argv: list[str]) -> tuple[int, float]:
  """(peak RSS in bytes, seconds) of `python ARGV` in a fresh process, as the process reports it."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  start = time.perf_counter()
  p = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                     stderr=subprocess.PIPE, text=True)
  seconds = time.perf_counter() - start
  if p.returncode:
    raise RuntimeError(f"{' '.join(argv)} failed: {p.stderr[-2000:]}")
  return int(p.stderr.rsplit("PEAK_KIB ", 1)[1].split()[0]) * 1024, seconds


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--d_ff", type=int, default=2816)
  parser.add_argument("--vocab", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv_heads", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  tmp = tempfile.mkdtemp(prefix="convert_memory_")
  try:
    hf_dir = os.path.join(tmp, "hf")
    sizes = write_hf(hf_dir, args.layers, args.d_model, args.d_ff, args.vocab, args.heads, args.kv_heads)
    runs = {"baseline": [], "shapes": [], "import": [], "export": [], "reference": []}
    for r in range(args.repeats):
      wd, out = os.path.join(tmp, f"wd{r}"), os.path.join(tmp, f"out{r}")
      runs["baseline"].append(peak_rss([BASELINE]))
      runs["shapes"].append(peak_rss([SHAPES, hf_dir]))
      runs["import"].append(peak_rss(["-m", "jaxtrain", "convert", "--from_hf", hf_dir, "--to", wd]))
      runs["export"].append(peak_rss(["-m", "jaxtrain", "convert", "--from", wd, "--to_hf", out]))
      runs["reference"].append(peak_rss([REFERENCE, hf_dir]))
      shutil.rmtree(wd)
      shutil.rmtree(out)
    report(args, sizes, {k: (statistics.median(p for p, _ in v), statistics.median(t for _, t in v))
                         for k, v in runs.items()})
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def report(args, sizes, med):
  mib = 2**20
  base = med["baseline"][0]
  fixed = med["shapes"][0] - base
  command = "python benchmarks/convert_memory.py " + " ".join(
      f"--{k} {v}" for k, v in vars(args).items())
  lines = [
      f"### convert: peak host memory vs the largest tensor ({datetime.date.today()})",
      "",
      f"- hardware: {cpu_name()}, {os.cpu_count()} cores; python {platform.python_version()}, "
      f"jax {importlib.metadata.version('jax')}, orbax-checkpoint {importlib.metadata.version('orbax-checkpoint')}, "
      f"tensorstore {importlib.metadata.version('tensorstore')}",
      f"- command: `{command}` (medians of {args.repeats})",
      f"- model: {args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, vocab {args.vocab}, "
      f"heads {args.heads}/{args.kv_heads}, f32, untied: {sizes['model'] / mib:.0f} MiB in 2 shards; "
      f"largest jaxtrain leaf {sizes['largest_leaf'] / mib:.0f} MiB, "
      f"largest HF tensor {sizes['largest_hf'] / mib:.0f} MiB",
      f"- baseline (imports + CPU backend): {base / mib:.0f} MiB peak RSS; tracing the model for its "
      f"parameter shapes (`hf.leaf_plan`, both directions do it) adds a fixed {fixed / mib:.0f} MiB",
      "",
      "| run | peak RSS | extra over baseline | extra / largest leaf | (extra - fixed) / largest leaf "
      "| extra / model | time | MB/s |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for name, label in [("import", "convert --from_hf (streamed)"), ("export", "convert --to_hf (streamed)"),
                      ("reference", "hf.import_hf (whole model, reference)")]:
    peak, seconds = med[name]
    extra = peak - base
    lines.append(f"| {label} | {peak / mib:.0f} MiB | {extra / mib:.0f} MiB | {extra / sizes['largest_leaf']:.2f} "
                 f"| {(extra - fixed) / sizes['largest_leaf']:.2f} | {extra / sizes['model']:.2f} | {seconds:.1f} s "
                 f"| {sizes['model'] / 1e6 / seconds:.0f} |")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
