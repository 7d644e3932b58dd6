"""What runs while an asynchronous collective is in flight, read off a compiled module's schedule.

A compiled module (`jit(f).lower(...).compile().as_text()`, `is_scheduled=true`) lists each
computation's instructions in the order they run. An asynchronous collective is a pair: on XLA:GPU
`X-start` and `X-done` (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), on
XLA:TPU fusions named `async-collective-start.N` / `-done.N` around the collective; what the
schedule puts between them runs while its bytes travel. `spans(text)` gives, for every such pair of
a computation, the instructions in between; `Span.compute` keeps the fusions and other kernels
among them (the work that may hide the transfer). `windows(text)` counts, per pair, the matmul
FLOPs run in between (each kernel credited to one transfer), what `comm --target` hides a transfer
behind. XLA:TPU (libtpu 0.0.42.1) leaves an all-reduce synchronous (an `all-reduce` instruction,
no pair) in the programs tried here (benchmarks/RESULTS.md, "Overlapped DiLoCo syncs")."""

import dataclasses
import re

import numpy as np

from jaxtrain.parallel import hlo_bytes

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*.*?\s([a-z][a-z0-9-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# what the schedule may interleave with a transfer and is not itself bookkeeping
_COMPUTE = ("fusion", "custom-call", "convolution", "dot")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  op_name: str  # metadata op_name ("" when XLA left none)
  operands: str  # the text after the opcode's "(" (operands and attributes)


@dataclasses.dataclass(frozen=True)
class Span:
  """An asynchronous collective and what runs between its start and its done."""
  computation: str
  kind: str  # "all-reduce", "all-to-all", ...
  start: Instruction
  done: Instruction
  between: tuple[Instruction, ...]

  @property
  def compute(self) -> tuple[Instruction, ...]:
    return tuple(i for i in self.between if i.opcode in _COMPUTE)


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
  """Each computation's instructions, in schedule order."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if stripped.endswith("{") and " = " not in stripped:  # a computation begins
      current = stripped.split()[1] if stripped.startswith("ENTRY") else stripped.split()[0]
      out[current.lstrip("%")] = []
      current = current.lstrip("%")
      continue
    if stripped == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if current is not None and m:
      op_name = _OP_NAME.search(line)
      out[current].append(Instruction(m.group(1), m.group(2), op_name.group(1) if op_name else "",
                                      m.group(3)))
  return out


_TPU_ASYNC = re.compile(r"^async-collective-(start|done)(\.\d+)?$")


def _async_role(name: str, opcode: str, operands: str) -> tuple[str, str] | None:
  """("start" or "done", the key that pairs them) of an asynchronous collective's two halves, else
  None. XLA:GPU: `X-start` and `X-done(%start)`. XLA:TPU's async collective fusions: fusions named
  `async-collective-start.N` and `async-collective-done.N`, the collective inside the start's
  fused computation."""
  tpu = _TPU_ASYNC.match(name) if opcode == "fusion" else None
  if tpu:
    return tpu.group(1), f"async-collective{tpu.group(2) or ''}"
  kind = opcode.rsplit("-", 1)[0]
  if kind not in hlo_bytes.KINDS and kind != "async":  # copy-start, send, recv: not collectives
    return None
  if opcode.endswith("-start"):
    return "start", name
  if opcode.endswith("-done"):
    operand = re.search(r"%([\w.-]+)", operands)
    return "done", operand.group(1) if operand else ""
  return None


def _callees(operands: str) -> list[str]:
  return re.findall(r"\bcalls=%?([\w.\-]+)", operands)


def spans(hlo_text: str) -> list[Span]:
  """Every asynchronous collective of the module with what its computation runs in between."""
  out, comps = [], computations(hlo_text)
  for name, instructions in comps.items():
    started = {}
    for index, inst in enumerate(instructions):
      role = _async_role(inst.name, inst.opcode, inst.operands)
      if role and role[0] == "start":
        started[role[1]] = index
      elif role and role[1] in started:
        begin = started.pop(role[1])
        start = instructions[begin]
        kind = start.opcode[:-len("-start")] if start.opcode.endswith("-start") else next(
            (i.opcode for c in _callees(start.operands) for i in comps.get(c, [])
             if i.opcode in hlo_bytes.KINDS), "async-collective")
        out.append(Span(name, kind, start, inst, tuple(instructions[begin + 1:index])))
  return out


# ---- how much compute a transfer may hide behind: matmul FLOPs in schedule order ----

_CONTRACTING = re.compile(r'lhs_contracting_dim(?:s=\{|ensions":\[)([^}\]]*)')
_GEMM_TARGETS = ("gemm", "matmul")  # cuBLAS(Lt) custom calls: __cublas$gemm, __cublas$lt$matmul


def _dims(shape: str) -> list[int]:
  """The dimensions of the first array in an HLO shape (a tuple's first element)."""
  m = re.search(r"\b[a-z]\w*\[([^\]]*)\]", shape)
  return [int(d) for d in m.group(1).split(",") if d.strip()] if m else []


def _operand_dims(operand: str, shapes: dict[str, str]) -> list[int]:
  return _dims(operand if "[" in operand else shapes.get(operand.split()[-1].lstrip("%"), ""))


def _window(attrs: str, key: str, n: int, default: int) -> list[list[int]]:
  """A convolution's window attribute `key` (size, stride, pad, lhs_dilate, rhs_dilate) per spatial
  dimension: `AxB` -> [[A], [B]], pads `L_HxL_H` -> [[L, H], ...]."""
  m = re.search(rf"\b{key}=([\d_x]+)", attrs)
  if not m:
    return [[default] * (2 if key == "pad" else 1) for _ in range(n)]
  return [[int(v) for v in d.split("_")] for d in m.group(1).split("x")]


def _convolution_flops(out: list[int], operands: list[list[int]], attrs: str) -> float:
  """Multiply-adds x 2 of an HLO convolution that hit real input (not padding or dilation holes):
  XLA:TPU writes a batched matmul's batch dimensions as spatial ones with padded, dilated windows,
  where most window taps land on nothing. Per output element: the kernel's input features x the
  window taps that land on an input element, counted exactly per spatial dimension."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
  if not labels or len(operands) < 2 or not operands[0] or not operands[1] or not out:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  lhs, rhs = operands
  spatial = [c for c in out_l if c.isdigit()]
  n = len(spatial)
  size, stride = _window(attrs, "size", n, 1), _window(attrs, "stride", n, 1)
  pad, lhs_dilate = _window(attrs, "pad", n, 0), _window(attrs, "lhs_dilate", n, 1)
  rhs_dilate = _window(attrs, "rhs_dilate", n, 1)
  macs = float(rhs[rhs_l.index("i")]) * float(np.prod(
      [out[i] for i, c in enumerate(out_l) if not c.isdigit()]))
  for d, c in enumerate(sorted(spatial, key=int)):
    extent = (lhs[lhs_l.index(c)] - 1) * lhs_dilate[d][0] + 1  # the dilated input
    o = np.arange(out[out_l.index(c)])[:, None]
    k = np.arange(size[d][0])[None, :]
    position = o * stride[d][0] + k * rhs_dilate[d][0] - pad[d][0]
    macs *= float(np.count_nonzero((position >= 0) & (position < extent)
                                   & (position % lhs_dilate[d][0] == 0)))
  return 2.0 * macs


class _Flops:
  """Matmul FLOPs (2 per multiply-add) of each instruction of a compiled module, called
  computations, loops (body x trip count) and conditionals (the largest branch) included."""

  def __init__(self, hlo_text: str):
    self.comps = hlo_bytes._computations(hlo_text)
    self.memo: dict[str, float] = {}

  def computation(self, name: str) -> float:
    if name not in self.memo:
      self.memo[name] = 0.0  # a cycle (none in valid HLO) counts nothing rather than recursing
      insts = self.comps.get(name, [])
      shapes = {inst[0]: inst[1] for inst in insts}
      self.memo[name] = sum(self.instruction(inst, insts, shapes) for inst in insts)
    return self.memo[name]

  def instruction(self, inst, insts, shapes) -> float:
    _, shape, opcode, operands, attrs = inst
    out = float(np.prod(_dims(shape)))
    target = re.search(r'custom_call_target="([^"]*)"', attrs)
    if opcode == "dot" or (opcode == "custom-call" and target and
                           any(t in target.group(1) for t in _GEMM_TARGETS)):
      contracting = _CONTRACTING.search(attrs)
      lhs = _operand_dims(operands[0], shapes) if operands else []
      k = np.prod([lhs[int(d.strip(' "'))] for d in contracting.group(1).split(",")
                   if d.strip(' "')]) if contracting and lhs else 1
      return 2.0 * out * float(k)
    if opcode == "convolution":  # XLA:TPU writes matmuls as convolutions
      return _convolution_flops(_dims(shape), [_operand_dims(o, shapes) for o in operands[:2]],
                                attrs)
    if opcode == "while":
      body = re.search(r"\bbody=%?([\w.\-]+)", attrs)
      trips = hlo_bytes._trip_count(self.comps, insts, operands, attrs)
      return trips * self.computation(body.group(1)) if body else 0.0
    if opcode == "conditional":
      listed = re.search(r"branch_computations=\{([^}]*)\}", attrs)
      branches = re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else []
      branches += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", attrs)
      return max((self.computation(b) for b in branches), default=0.0)
    if opcode in ("fusion", "call", "async-start"):
      return sum(self.computation(c) for c in _callees(attrs))
    return 0.0


@dataclasses.dataclass(frozen=True)
class Windows:
  """The compute each asynchronous collective of a module may hide behind."""
  flops: float  # matmul FLOPs of one execution of the module
  window: dict[str, float]  # an async pair's key (its start's name) -> matmul FLOPs run in between
  inner: dict[str, str]  # a collective wrapped in an async computation or fusion -> its pair's key

  def of(self, name: str) -> float:
    """Matmul FLOPs run while the collective `name` (hlo_bytes.Collective.name) is in flight; 0 for
    a synchronous one."""
    return self.window.get(self.inner.get(name, name), 0.0)


def windows(hlo_text: str) -> Windows:
  """Per asynchronous collective, the matmul FLOPs the schedule runs between its start and its done.
  One link carries one transfer at a time: a kernel that runs while several are in flight counts
  for the one that started first, so the windows add up to no more than the compute there is."""
  flops = _Flops(hlo_text)
  window, inner = {}, {}
  for name, insts in flops.comps.items():
    shapes = {inst[0]: inst[1] for inst in insts}
    in_flight = []  # the keys of the transfers in flight, oldest first
    for inst in insts:
      iname, _, opcode, operands, attrs = inst
      role = _async_role(iname, opcode, " ".join(operands))
      if role and role[0] == "start":
        in_flight.append(role[1])
        window[role[1]] = 0.0
        for callee in _callees(attrs):  # the collective an async computation or fusion wraps
          for wrapped in flops.comps.get(callee, []):
            inner[wrapped[0]] = role[1]
      elif role and role[1] in in_flight:
        in_flight.remove(role[1])
      elif in_flight:
        window[in_flight[0]] += flops.instruction(inst, insts, shapes)
  return Windows(flops.computation(""), window, inner)
