"""Bytes a compiled module copies between a device's memory and its host's (host offload,
train.offload): read off the compiled HLO's layouts, whose host memory space is `S(5)`."""

from jaxtrain.parallel.hlo_bytes import _computations, _runs, _split_top, shape_parts


HOST_SPACE = "S(5)"  # the host memory space in a compiled layout: `f32[8]{0:T(1024)S(5)}`


def host_transfers(hlo_text: str) -> dict[str, float]:
  """Bytes one device copies between its memory and the host's per execution of a compiled module,
  {"to_host": ..., "to_device": ...}, times the runs of each instruction's computation (a scanned
  layer's once per layer): copies (`copy-start`, `copy`) whose source or destination layout is in
  the host memory space, slices read from a host buffer into the device (`dynamic-slice-start`) and
  device slices written into one (`dynamic-update-slice-start`: remat's offloaded residuals)."""
  comps = _computations(hlo_text)
  runs, out = _runs(comps), {"to_host": 0.0, "to_device": 0.0}
  on_host = lambda shape: HOST_SPACE in shape
  for comp, insts in comps.items():
    shapes = {name: shape for name, shape, *_ in insts}
    for _, shape, opcode, operands, _ in insts:
      parts = _split_top(shape.strip()[1:-1]) if shape.strip().startswith("(") else []
      if opcode == "copy-start":  # (destination, source, context)
        dst, src = parts[:2]
      elif opcode == "copy" and operands:
        dst, src = shape, shapes.get(operands[0].split()[-1].lstrip("%"), "")
      elif opcode == "dynamic-slice-start":  # ((buffer, indices...), slice, context)
        src, dst = _split_top(parts[0][1:-1])[0], parts[1]
      elif opcode == "dynamic-update-slice-start":  # ((buffer, update, indices...), result)
        dst, src = _split_top(parts[0][1:-1])[:2]
      else:
        continue
      if on_host(dst) != on_host(src):
        moved = src if opcode == "dynamic-update-slice-start" else dst
        key = "to_host" if on_host(dst) else "to_device"
        out[key] += sum(b for _, b in shape_parts(moved)) * runs[comp]
  return out
