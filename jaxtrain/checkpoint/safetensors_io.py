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
READ_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16)}
BLOCK_BYTES = 8 * 2**20  # rows copied per read or write


def tensor_index(hf_dir: str) -> dict:
  """HF tensor name -> (file, dtype code, shape, byte offset), from the safetensors headers only."""
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted({os.path.join(hf_dir, v) for v in json.load(f)["weight_map"].values()})
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
  where = {}
  for path in files:
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    for name, entry in header.items():
      if name == "__metadata__":
        continue
      if entry["dtype"] not in READ_DTYPES:
        raise ValueError(f"{name} has dtype {entry['dtype']}; supported: {', '.join(READ_DTYPES)}")
      where[name] = (path, entry["dtype"], tuple(entry["shape"]), 8 + n + entry["data_offsets"][0])
  return where


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
        f.write(memoryview(np.ascontiguousarray(w[r:r + rows], np_dtype).reshape(-1).view(np.uint8)))
      del w
  os.replace(path + ".tmp", path)
