"""Metric sinks (metrics.jsonl, TensorBoard), FLOP counting and model FLOPs utilization (MFU).

A sink: it takes plain dicts and numbers and imports nothing else from jaxtrain.
"""

import json
import os
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense peak FLOP/s per chip, by device_kind substring (vendor datasheets, no sparsity).
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "L4": {"bfloat16": 121e12, "float32": 30e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    # device_kind: v5e is "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite" (matched in this order)
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6": {"bfloat16": 918e12, "float32": 918e12},
}


def train_flops_per_token(n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab_size,
                          seq_len, mlp_params=None):
  """Matmul FLOPs of forward + backward per token: 6 * (matmul params) + attention.

  `mlp_params`: the feed-forward matmul parameters one token goes through, all layers (MoE: the
  active experts, shared experts and router); default n_layers * 3 * d_model * d_ff (SwiGLU).

  Attention counts QK^T and PV over the full L x L score matrix (as computed, no causal halving):
  per layer forward 2 * 2 * L * H * K per token (Chowdhery et al., 2022, appendix B)."""
  attn_proj = d_model * head_dim * (2 * n_heads + 2 * n_kv_heads)
  mlp_params = n_layers * 3 * d_model * d_ff if mlp_params is None else mlp_params
  matmul_params = n_layers * attn_proj + mlp_params + d_model * vocab_size  # output projection
  attention = n_layers * 4 * seq_len * n_heads * head_dim
  return 6 * matmul_params + 3 * attention


def measure_matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 7) -> float:
  """FLOP/s of a large square matmul on the default device: the CPU's practical peak, from the
  fastest of `repeats` runs (a peak: other processes on a shared host only ever slow a run down; a
  median measured under load made the MFU of a later, quieter step exceed 1)."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / min(times)


_measured_peak = {}


def peak_flops(dtype_name: str = "float32", kept: str | None = None) -> tuple[float, str]:
  """Peak FLOP/s of one local device: the table for known accelerators, else a probe (cached in
  the process, and in the JSON file `kept` by host, device kind and dtype, so that a restart on
  the same host skips the probe's seconds)."""
  device = jax.local_devices()[0]
  for name, peaks in PEAK_FLOPS.items():
    if name in device.device_kind:
      return peaks[dtype_name], f"table:{name}"
  key = f"{socket.gethostname()}/{device.platform}/{device.device_kind}/{dtype_name}"
  known = _read_json(kept) if kept else {}
  if dtype_name not in _measured_peak:
    _measured_peak[dtype_name] = known.get(key) or measure_matmul_peak(dtype=jnp.dtype(dtype_name))
  if kept and key not in known:
    _write_json(kept, {**known, key: _measured_peak[dtype_name]})
  # On CPU the virtual devices share the cores: the probe measures the whole host.
  return _measured_peak[dtype_name], f"probe:{device.platform}"


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):  # none yet, or unreadable: probe again
    return {}


def _write_json(path: str, value: dict):
  """Replaced atomically (processes of several hosts may write it)."""
  try:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
      json.dump(value, f)
    os.replace(f"{path}.{os.getpid()}.tmp", path)
  except OSError:  # a read-only workdir: the next start probes again
    pass


class MetricsWriter:
  """Appends one JSON object per logged step to DIR/metrics.jsonl and scalars to DIR/tb/."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    SummaryWriter = _summary_writer()
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    torn = os.path.isfile(path) and os.path.getsize(path) and _last_byte(path) != b"\n"
    self._jsonl = open(path, "a")
    if torn:  # a killed run left half a line: end it, so that the next row stands alone
      self._jsonl.write("\n")
    self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, scalars: dict):
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(k, v, int(step))

  def close(self):
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def _summary_writer():
  """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when it is
  installed (seconds at every start, for tensor types this writer never gets)."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def _plain(v):
  v = np.asarray(v)
  return v.item() if v.size == 1 else v.tolist()


def _last_byte(path: str) -> bytes:
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    return f.read(1)


def read_metrics(workdir: str, as_frame: bool | None = False):
  """The rows of DIR/metrics.jsonl (a line cut short by a killed run is skipped) as a list of dicts;
  with `as_frame` a pandas DataFrame (a row per line, a column per key, `step` first), with None one
  when pandas is installed (`jaxtrain.read_metrics`)."""
  rows = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  if as_frame is None:
    import importlib.util
    as_frame = importlib.util.find_spec("pandas") is not None
  if not as_frame:
    return rows
  import pandas as pd
  frame = pd.DataFrame(rows)
  return frame[["step", *(c for c in frame.columns if c != "step")]] if "step" in frame else frame
