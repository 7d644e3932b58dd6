"""What runs while an asynchronous collective is in flight, read off a compiled module's schedule.

A compiled module (`jit(f).lower(...).compile().as_text()`, `is_scheduled=true`) lists each
computation's instructions in the order they run. An asynchronous collective is a pair, `X-start`
and `X-done` (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute); what the schedule
puts between them runs while its bytes travel. `spans(text)` gives, for every such pair of a
computation, the instructions in between; `Span.compute` keeps the fusions and other kernels among
them (the work that may hide the transfer). XLA:GPU makes collectives asynchronous by default;
XLA:TPU (libtpu 0.0.42.1) leaves an all-reduce synchronous (an `all-reduce` instruction, no pair)
in the programs tried here (benchmarks/RESULTS.md, "Overlapped DiLoCo syncs")."""

import dataclasses
import re

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


def spans(hlo_text: str) -> list[Span]:
  """Every asynchronous collective of the module with what its computation runs in between."""
  out = []
  for name, instructions in computations(hlo_text).items():
    started = {}
    for index, inst in enumerate(instructions):
      if inst.opcode.endswith("-start"):
        started[inst.name] = index
      elif inst.opcode.endswith("-done"):
        operand = re.search(r"%([\w.-]+)", inst.operands)
        begin = started.pop(operand.group(1), None) if operand else None
        if begin is not None:
          out.append(Span(name, inst.opcode[:-len("-done")], instructions[begin], inst,
                          tuple(instructions[begin + 1:index])))
  return out
