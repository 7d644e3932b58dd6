"""Bytes that collectives send, counted in compiled HLO text
(`jit(f).lower(...).compile().as_text()`).

Compiled, never StableHLO: XLA:CPU widens narrow collectives (bf16 -> f32, fp8 -> f16, int4 -> s8),
so only the compiled module says what crosses the wire. One row per collective instruction
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute; their `-start` forms count,
`-done` not).

Bytes one device sends, under ring algorithms over a group of G devices:

  all-reduce          2 (G-1)/G x operand bytes    (a reduce-scatter, then an all-gather)
  all-gather            (G-1)/G x result bytes     (= (G-1) x operand bytes)
  reduce-scatter        (G-1)/G x operand bytes
  all-to-all            (G-1)/G x operand bytes    (it keeps its own 1/G)
  collective-permute              operand bytes

A tuple-shaped collective (XLA combines many into one) counts the sum of its parts; s4/u4 count half
a byte per element, f8* one, bf16 two. Per optimizer step, `per_step = bytes_sent / every`: a
collective whose metadata op_name has a path component `comm_every_N`
(`jax.named_scope(f"comm_every_{N}")`) runs once every N steps (a DiLoCo sync inside lax.cond is in
the HLO once but runs only when its branch runs); nested ones multiply. Without one, it runs every
step. A collective inside a while loop (a scan over layers or microbatches) runs the loop's trip
count times per step (`runs`; once where XLA does not know the count):
`per_step = bytes_sent x runs / every`.

Replica-group ids are logical (replica x partitions + partition), not `device.id`: they index the
executable's device assignment, which for a jit over shardings of `mesh` is `mesh.devices.flat`. A
group's mesh axes are those along which its members' mesh coordinates differ.
"""

import dataclasses
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_FACTOR = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
           "reduce-scatter": lambda g: (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
           "collective-permute": lambda g: 1.0}
_BITS = {"pred": 8, "token": 0, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_EVERY = re.compile(r"(?:^|[/(])comm_every_(\d+)(?=$|[/)])")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled module, and the bytes one device sends for it."""
  name: str  # the instruction's name in the HLO
  kind: str  # one of KINDS (an async `-start` counts as its op)
  dtypes: tuple[str, ...]  # operand element types, in order
  operand_bytes: float
  result_bytes: float
  group_size: int
  axes: tuple[str, ...]  # mesh axes the groups span, in mesh order
  every: int  # runs once every `every` optimizer steps (comm_every_N scopes)
  runs: int  # times per execution of the module (inside while loops: their trip counts)
  op_name: str  # metadata op_name ("" when XLA left none)
  bytes_sent: float  # per device, each time it runs
  operand_bytes_by_dtype: tuple[tuple[str, float], ...]

  @property
  def per_step(self) -> float:
    return self.bytes_sent * self.runs / self.every

  @property
  def dtype(self) -> str:
    return "+".join(sorted(set(self.dtypes)))


def element_bits(dtype: str) -> int:
  """Bits per element of an HLO element type (s4 -> 4, f8e4m3fn -> 8, bf16 -> 16)."""
  if dtype in _BITS:
    return _BITS[dtype]
  if m := re.fullmatch(r"[su](\d+)|f(\d)e\d+m\d+\w*", dtype):
    return int(m.group(1) or m.group(2))
  raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_parts(shape: str) -> list[tuple[str, float]]:
  """(element type, bytes) of each array in an HLO shape: `f32[1024]{0}`, `pred[]`, a tuple of
  them."""
  parts = []
  for dtype, dims in _ARRAY.findall(shape):
    count = int(np.prod([int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]))
    parts.append((dtype, count * element_bits(dtype) / 8))
  return parts


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] in "([{"
    depth -= text[i] in ")]}"
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
  """`text` split at the commas outside any bracket."""
  out, depth, cur = [], 0, ""
  for ch in text:
    depth += (ch in "([{") - (ch in ")]}")
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return out + [cur.strip()] if cur.strip() else out


def _instruction(line: str):
  """(name, shape, opcode, operands, attributes) of an instruction line, else None."""
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
  if not m:
    return None
  i = m.end()
  j = _balanced(line, i) if line[i:i + 1] == "(" else line.find(" ", i)
  op = re.compile(r"\s*([\w\-]+)\(").match(line, j) if j > 0 else None
  if not op:
    return None
  end = _balanced(line, op.end() - 1)
  operands = re.sub(r"/\*.*?\*/", "", line[op.end():end - 1])  # XLA notes /*index=5*/ in long lists
  return m.group(1), line[i:j], op.group(1), _split_top(operands), line[end:]


def _groups(attrs: str, kind: str, replicas: int, partitions: int) -> list[list[int]]:
  """Each group's members as positions in the device assignment (replica x partitions +
  partition)."""
  if kind == "collective-permute":
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    ids = ([[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))]
           if pairs else [])
  else:
    ids = _replica_groups(attrs)
  channel, flat = "channel_id=" in attrs, "use_global_device_ids=true" in attrs
  if flat:
    space, expand = replicas * partitions, lambda g: [g]
  # cross-partition: ids are partitions
  elif channel and (kind in ("all-to-all", "collective-permute")):
    space, expand = partitions, lambda g: [[r * partitions + p for p in g] for r in range(replicas)]
  elif channel:  # cross-replica-and-partition: each replica of a group, with all its partitions
    space, expand = replicas, lambda g: [[r * partitions + p for r in g for p in range(partitions)]]
  else:  # cross-replica: ids are replicas, once per partition
    space, expand = replicas, lambda g: [[r * partitions + p for r in g] for p in range(partitions)]
  ids = ids or [list(range(space))]
  if kind == "collective-permute":
    ids = _cycles(ids)
  return [members for g in ids for members in expand(g)]


def _replica_groups(attrs: str) -> list[list[int]]:
  """`replica_groups=` in any of the forms XLA prints; [] for `{}` (everyone).

  Listed `{{0,2},{1,3}}`; iota `[2,4]<=[4,2]T(1,0)` (groups [2,4] of iota(8) reshaped [4,2],
  transposed); mesh axes `mesh['a'=4,'b'=2] {'a'}` (the devices that differ only along the named
  axes; a sub-axis `'a':(p)s` is the middle factor s of axis a split major-to-minor as [p, s,
  rest])."""
  if m := re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs):
    return _iota(m.group(1)).tolist()
  if m := re.search(r"replica_groups=maximal_mesh\[device_id=(\d+)\]", attrs):
    return [[int(m.group(1))]]
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\]", attrs):
    return _mesh_groups(attrs, m)
  listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
  if not listed:
    raise ValueError(f"no replica_groups this module understands in {attrs[:200]!r}")
  return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]


def _iota(text: str) -> np.ndarray | None:
  """`[2,4]<=[4,2]T(1,0)`: iota over the reshape dims [4,2], transposed, reshaped to the leading
  dims (a mesh's device_ids print without them: `[4,2]T(1,0)`, flat). None for any other text."""
  m = re.fullmatch(r"(?:devices=)?(?:\[([\d,]+)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if not m:
    return None
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  return ids.reshape([int(x) for x in m.group(1).split(",")] if m.group(1) else -1)


def _mesh_groups(attrs: str, m) -> list[list[int]]:
  names, sizes = zip(
      *[(n.strip("'"), int(v)) for n, v in (a.rsplit("=", 1) for a in _split_top(m.group(1)))])
  rest = attrs[m.end():]
  ids = np.arange(int(np.prod(sizes)))
  if rest.startswith(", device_ids=("):
    end = _balanced(rest, len(", device_ids="))
    listed = rest[len(", device_ids=("):end - 1]
    ids = _iota(listed)
    ids = np.array([int(x) for x in re.findall(r"\d+", listed)]) if ids is None else ids.ravel()
    rest = rest[end:]
  grouped = {}  # mesh dim -> [(pre, size)] of the sub-axes named (a full axis: (1, its size))
  for axis in re.findall(r"('[^']*'|[^,{}\s:]+)(?::\((\d+)\)(\d+))?",
                         re.match(r"\s*\{([^}]*)\}", rest).group(1)):
    dim = names.index(axis[0].strip("'"))
    grouped.setdefault(dim, []).append((int(axis[1]), int(axis[2])) if axis[1] else (1, sizes[dim]))
  fine, keep = [], []  # the mesh's dims split into sub-axes; which of them are grouped
  for dim, n in enumerate(sizes):
    at = 1
    for pre, size in sorted(grouped.get(dim, [])):
      fine += [pre // at, size]
      keep += [False, True]
      at = pre * size
    fine.append(n // at)
    keep.append(False)
  order = [i for i, k in enumerate(keep) if not k] + [i for i, k in enumerate(keep) if k]
  g = int(np.prod([f for f, k in zip(fine, keep) if k]))
  return ids.reshape(fine).transpose(order).reshape(-1, g).tolist()


def _cycles(pairs: list[list[int]]) -> list[list[int]]:
  """The devices a collective-permute's source->target pairs connect, one list per connected set."""
  sets = []
  for a, b in pairs:
    touching = [s for s in sets if a in s or b in s]
    merged = {a, b}.union(*touching)
    sets = [s for s in sets if s not in touching] + [merged]
  return [sorted(s) for s in sets]


def _axes(groups: list[list[int]], mesh) -> tuple[str, ...]:
  """Mesh axes along which members of some group differ in their mesh coordinates."""
  shape = mesh.devices.shape
  varying = set()
  for g in groups:
    coords = np.stack(np.unravel_index(np.asarray(g), shape), axis=-1)
    varying |= {i for i in range(len(shape)) if len(set(coords[:, i])) > 1}
  return tuple(mesh.axis_names[i] for i in sorted(varying))


def every_of(op_name: str) -> int:
  """How many optimizer steps apart a collective runs: the product of its `comm_every_N` scopes."""
  every = 1
  for n in _EVERY.findall(op_name):
    if int(n) < 1:
      raise ValueError(f"comm_every_{n} in {op_name!r}: N must be a positive integer")
    every *= int(n)
  return every


def _header_count(header: str, key: str) -> int:
  m = re.search(rf"\b{key}=(\d+)", header)
  return int(m.group(1)) if m else 1


def _computations(hlo_text: str) -> dict[str, list]:
  """{computation name: its instructions (name, shape, opcode, operands, attributes)}, ENTRY under
  ""."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    if line.rstrip().endswith("{") and " = " not in line:  # a computation begins
      head = re.match(r"\s*(ENTRY\s+)?%?([\w.\-]+)", line)
      current = comps.setdefault("" if head.group(1) else head.group(2), [])
    elif current is not None and (inst := _instruction(line)):
      current.append(inst)
  return comps


def _runs(comps: dict[str, list]) -> dict[str, int]:
  """How many times each computation runs per execution of the module: a while body its loop's known
  trip count (once when XLA does not know it) times its caller's runs; other callees as often as
  their caller (a conditional's branch at most that often; `comm_every_N` says how rarely)."""
  callers = {}
  for caller, insts in comps.items():
    for _, _, opcode, operands, attrs in insts:
      trips = _trip_count(comps, insts, operands, attrs) if opcode == "while" else 1
      for key, callee in re.findall(
          r"\b(body|condition|calls|to_apply|\w+_computations?)=\{?%?([\w.\-]+)", attrs):
        callers.setdefault(callee, []).append((caller, trips if key == "body" else 1))
      for group in re.findall(r"\w+_computations=\{([^}]*)\}", attrs):
        for callee in re.findall(r"%?([\w.\-]+)", group)[1:]:  # the first one was found above
          callers.setdefault(callee, []).append((caller, 1))
  runs = {"": 1}

  def count(name: str) -> int:
    if name not in runs:
      runs[name] = sum(count(caller) * trips for caller, trips in callers.get(name, []))
    return runs[name]
  return {name: count(name) for name in comps}


def _trip_count(comps: dict[str, list], caller: list, operands: list, attrs: str) -> int:
  """A while loop's trip count: XLA's `known_trip_count` (CPU, GPU), else read off the loop (TPU
  leaves none): a condition `counter < N` on a tuple element that the loop's init sets to a
  constant c (or a copy of one) gives N - c; anything else counts once."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
  if known:
    return int(known.group(1))
  cond = re.search(r"\bcondition=%?([\w.\-]+)", attrs)
  insts = {name: (opcode, ops, a) for name, _, opcode, ops, a in comps.get(cond.group(1), [])} \
      if cond else {}
  ref = lambda o: o.split()[-1].lstrip("%")
  for opcode, ops, a in insts.values():
    if opcode != "compare" or "direction=LT" not in a or len(ops) != 2:
      continue
    counter, limit = insts.get(ref(ops[0])), insts.get(ref(ops[1]))
    if not (counter and limit and counter[0] == "get-tuple-element" and limit[0] == "constant"):
      continue
    index = re.search(r"index=(\d+)", counter[2])
    here = {name: (opcode, ops) for name, _, opcode, ops, _ in caller}
    init = here.get(ref(operands[0])) if operands else None
    start = 0
    if init and init[0] == "tuple" and index and int(index.group(1)) < len(init[1]):
      element = here.get(ref(init[1][int(index.group(1))]))
      while element and element[0] == "copy":  # a peeled loop's counter starts at a copied 1
        element = here.get(ref(element[1][0]))
      if element and element[0] == "constant" and element[1][0].lstrip("-").isdigit():
        start = int(element[1][0])
    if limit[1][0].lstrip("-").isdigit():
      return max(int(limit[1][0]) - start, 1)
  return 1


def collectives(hlo_text: str, mesh) -> list[Collective]:
  """One row per collective instruction of a compiled module's text, placed on `mesh`."""
  header = hlo_text.split("\n", 1)[0]
  replicas = _header_count(header, "replica_count")
  partitions = _header_count(header, "num_partitions")
  if replicas * partitions != mesh.devices.size:
    raise ValueError(
        f"the module runs on {replicas * partitions} devices, the mesh has {mesh.devices.size}")
  comps = _computations(hlo_text)
  runs, rows = _runs(comps), []
  for comp, insts in comps.items():
    shapes = {name: shape for name, shape, *_ in insts}  # names are the computation's own
    for name, shape, opcode, operands, attrs in insts:
      kind = opcode.removesuffix("-start")
      if kind in KINDS:
        rows.append(
            _row(name, shape, opcode, operands, attrs, shapes, runs[comp], mesh, replicas,
                 partitions, _period(insts)))
  return rows


def _period(insts: list) -> int:
  """The `comm_every_N` period of a computation's named collectives when they all agree (else 1):
  that of a collective a compiler pass wrote without metadata beside them (XLA:TPU rewrites the
  all-gather of a DiLoCo sync's conditional branch into an all-reduce with no op_name)."""
  periods = {every_of(m.group(1)) for _, _, opcode, _, attrs in insts
             if opcode.removesuffix("-start") in KINDS
             and (m := re.search(r'op_name="([^"]*)"', attrs))}
  return periods.pop() if len(periods) == 1 else 1


def _row(name, shape, opcode, operands, attrs, shapes, runs, mesh, replicas,
         partitions, period: int = 1) -> Collective:
  kind = opcode.removesuffix("-start")
  parts = [
      p for o in operands for p in shape_parts(o if "[" in o else shapes[o.split()[-1].lstrip("%")])
  ]
  groups = _groups(attrs, kind, replicas, partitions)
  g = max(len(members) for members in groups)
  operand_bytes = sum(b for _, b in parts)
  if opcode.endswith("-start"):  # the async result tuple also holds the operands: derive the result
    result_bytes = operand_bytes * (g if kind == "all-gather" else 1)
  else:
    result_bytes = sum(b for _, b in shape_parts(shape))
  counted = result_bytes if kind == "all-gather" else operand_bytes
  op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', attrs)) else ""
  by_dtype = {}
  for dtype, b in parts:
    by_dtype[dtype] = by_dtype.get(dtype, 0.0) + b
  return Collective(name, kind, tuple(d for d, _ in parts), operand_bytes, result_bytes, g,
                    _axes(groups, mesh), every_of(op_name) if op_name else period, runs, op_name,
                    _FACTOR[kind](g) * counted, tuple(by_dtype.items()))


def axes_str(axes: tuple[str, ...]) -> str:
  return ",".join(axes) or "-"


def by_axis(rows: list[Collective]) -> dict[tuple[str, str], float]:
  """Bytes per device per optimizer step by (mesh axes, element type); a mixed tuple is split by the
  share of each element type in its operands (the formulas are linear in them)."""
  table = {}
  for r in rows:
    for dtype, b in r.operand_bytes_by_dtype:
      key = (axes_str(r.axes), dtype)
      share = b / r.operand_bytes if r.operand_bytes else 0.0
      table[key] = table.get(key, 0.0) + r.per_step * share
  return table


def total(rows: list[Collective]) -> float:
  """Bytes one device sends per optimizer step, all collectives."""
  return sum(r.per_step for r in rows)



def syncs(rows: list[Collective]) -> dict[int, float]:
  """Bytes one device sends in one periodic sync, by its period: the collectives scoped
  comm_every_N (N > 1: a DiLoCo fragment's outer average, in the step that sends it) summed, each
  as often as it runs in that step. The average per step hides these peaks: a sync of the whole
  model every H steps and a fragment of it every H/P steps average the same."""
  out = {}
  for r in rows:
    if r.every > 1:
      out[r.every] = out.get(r.every, 0.0) + r.bytes_sent * r.runs
  return out
