"""safetensors files read and written a block of rows at a time, without memory-mapping them.

`tensor_index` lists the tensors of a directory's *.safetensors files (header only); `read_into`
copies one tensor (or one half of a fused one) into a preallocated array; `write_safetensors`
writes tensors produced one at a time. So a caller holds one tensor and one block, never a file
(`safetensors.safe_open` maps the file, and every page read then counts in resident memory).
"""

import glob
import json
import os
import struct

import jax.numpy as jnp
import numpy as np

SAFETENSORS_DTYPES = {"float32": ("F32", "<f4"), "bfloat16": ("BF16", jnp.bfloat16)}
READ_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
               "BF16": np.dtype(jnp.bfloat16)}
BLOCK_BYTES = 8 * 2**20  # rows copied per read or write


def tensor_index(hf_dir: str) -> dict:
  """HF tensor name -> (file, dtype code, shape, byte offset), from the safetensors headers only;
  each header is checked against its file's size (ValueError, one line, for a file cut short or
  malformed)."""
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    files = sorted({os.path.join(hf_dir, v) for v in _weight_map(index).values()})
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
      raise FileNotFoundError(f"{index} names {missing[0]}, which does not exist")
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
  where = {}
  for path in files:
    header, start = read_header(path)
    for name, entry in header.items():
      where[name] = (path, entry["dtype"], tuple(entry["shape"]), start + entry["data_offsets"][0])
  return where


def read_header(path: str) -> tuple[dict, int]:
  """(tensor name -> entry, byte where the data starts) of a safetensors file; ValueError (one line)
  unless every tensor's dtype, shape and byte range are valid and lie inside the file."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
    if n is None or n > size - 8:
      raise ValueError(
          f"{path} is not a complete safetensors file ({size} bytes, header of {n} bytes)")
    try:
      header = json.loads(f.read(n))
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
      raise ValueError(f"{path}: the safetensors header is not JSON") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: the safetensors header is not a JSON object")
  header.pop("__metadata__", None)
  for name, entry in header.items():
    _check_entry(path, name, entry, size - 8 - n)
  return header, 8 + n


def _check_entry(path: str, name: str, entry, data_bytes: int) -> None:
  """ValueError unless a header entry has a readable dtype, a shape and a byte range of that many
  bytes within the file's `data_bytes`."""
  if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
    raise ValueError(f"{path}: tensor {name} has a malformed header entry")
  if entry["dtype"] not in READ_DTYPES:
    raise ValueError(f"{name} has dtype {entry['dtype']}; supported: {', '.join(READ_DTYPES)}")
  shape, offsets = entry["shape"], entry["data_offsets"]
  if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and
          isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
    raise ValueError(f"{path}: tensor {name} has a malformed shape or data_offsets")
  begin, end = offsets
  nbytes = READ_DTYPES[entry["dtype"]].itemsize * int(np.prod(shape, dtype=np.int64))
  if not 0 <= begin <= end or end - begin != nbytes:
    raise ValueError(
        f"{path}: tensor {name} {shape} {entry['dtype']} needs {nbytes} bytes, its data_offsets "
        f"{offsets} hold {end - begin}")
  if end > data_bytes:
    raise ValueError(
        f"{path} is cut short: tensor {name} ends at data byte {end}, the file holds {data_bytes}")


def _weight_map(index: str) -> dict:
  """The weight_map of a model.safetensors.index.json;
  ValueError (one line) when it is malformed."""
  try:
    with open(index, "rb") as f:
      weight_map = json.loads(f.read())["weight_map"]
  except (ValueError, KeyError, TypeError):
    raise ValueError(f"{index} is not a safetensors index (JSON with a weight_map)") from None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise ValueError(f"{index}: weight_map is not an object of file names")
  return weight_map


def read_into(index: dict, name: str, out, half: int | None = None) -> None:
  """Copies HF tensor `name` (or, with `half`, the gate or up rows of a fused [E, 2F, D] tensor)
  into `out`, an array or view of that shape (cast to out's dtype), with plain reads."""
  path, code, shape, offset = index[name]
  dtype = READ_DTYPES[code]
  with open(path, "rb") as f:
    if half is None:
      _read_block_rows(f, offset, shape, dtype, out, name)
    else:  # expert e's half is one contiguous [F, D] run
      row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
      for e in range(shape[0]):
        _read_block_rows(f, offset + e * row + half * row // 2, out.shape[1:], dtype, out[e], name)


def _read_block_rows(f, offset: int, shape, dtype, out, name: str) -> None:
  """The C-ordered array of `shape` at byte `offset` of file f into `out`, a block of rows at a
  time; a row larger than a block (3-d and up) is read the same way, row by row."""
  row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
  if len(shape) > 2 and row > BLOCK_BYTES:
    for r in range(shape[0]):
      _read_block_rows(f, offset + r * row, shape[1:], dtype, out[r], name)
    return
  rows = max(1, BLOCK_BYTES // row)
  f.seek(offset)
  for r in range(0, shape[0], rows):
    block = np.empty((min(rows, shape[0] - r), *shape[1:]), dtype)
    if f.readinto(memoryview(block.reshape(-1).view(np.uint8))) != block.nbytes:
      raise ValueError(f"{f.name} ends inside tensor {name}")
    out[r:r + len(block)] = block


def write_safetensors(path: str, header_entries, tensors, dtype: str = "float32") -> None:
  """The safetensors format (u64 header size, JSON header, raw little-endian bytes), written one
  tensor at a time, a block of rows at a time. `header_entries`: (name, shape) in order; `tensors`
  yields (name, array of that shape), e.g. a view of a leaf."""
  code, np_dtype = SAFETENSORS_DTYPES[dtype]
  itemsize = np.dtype(np_dtype).itemsize
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in header_entries:
    nbytes = itemsize * int(np.prod(shape))
    header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path + ".tmp", "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for name, w in tensors:
      assert list(w.shape) == header[name]["shape"], (name, w.shape, header[name]["shape"])
      rows = max(1, BLOCK_BYTES // (itemsize * int(np.prod(w.shape[1:], dtype=np.int64))))
      for r in range(0, w.shape[0], rows):  # a block may be a view of the leaf: keep no name on it
        f.write(memoryview(
            np.ascontiguousarray(w[r:r + rows], np_dtype).reshape(-1).view(np.uint8)))
      del w
  os.replace(path + ".tmp", path)
