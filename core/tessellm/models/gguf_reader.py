"""A GGUF file's header, parsed in one pass: metadata fields and tensor infos, the tensors as
views of a copy-on-write memory map of the file.

The `gguf` package's reader makes a numpy view per field part (a vocabulary is several parts
per token, so seconds for a large one); this one reads strings with `struct` and numeric arrays
with one `numpy.frombuffer` each. Invariants:
- A field's `contents()` is its decoded value (str, int, float, bool, or a list of them);
  `types` is [value type] or [ARRAY, element type], as the `gguf` package spells them.
- A tensor's `data` has the `gguf` package's numpy shape: dense types (F32, F16, F64, I8..I64)
  as [ne_n, ..., ne_0] of their dtype, every other type as uint8 rows of
  ne_0 / block_size * type_size bytes; `shape` lists the dimensions fastest first.
- Bytes the header says exist but the file lacks (a cut header, a tensor past the end) are
  a ModelLoadError naming the file and saying it is truncated; only little-endian GGUF v2/v3
  files are read.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessellm.errors import ModelLoadError

DEFAULT_ALIGNMENT = 32
# GGUF value types: 0 UINT8, 1 INT8, 2 UINT16, 3 INT16, 4 UINT32, 5 INT32, 6 FLOAT32, 7 BOOL,
# 8 STRING, 9 ARRAY, 10 UINT64, 11 INT64, 12 FLOAT64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# dense tensor types -> numpy dtype: F32, F16, I8, I16, I32, I64, F64
_DENSE = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}


class _Truncated(Exception):
    """The header asks for bytes beyond the end of the file."""


@dataclass(slots=True)
class GGUFField:
    name: str
    value: Any
    types: list[Any]   # gguf.GGUFValueType: [type] or [ARRAY, element type]

    def contents(self) -> Any:
        return self.value

    @property
    def data(self) -> Any:   # the `gguf` package's name; len() of an array is its count
        return self.value


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: Any    # gguf.GGMLQuantizationType
    shape: tuple[int, ...]   # fastest dimension first, as GGUF lists them
    n_elements: int
    n_bytes: int
    data_offset: int    # absolute, in the file
    data: np.ndarray


@dataclass(slots=True)
class GGUFContents:
    path: Path
    version: int
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Truncated
        self.pos = start + n
        return start

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out, end = self.buf, self.pos, [], len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise _Truncated
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


def _value(cur: _Cursor, vtype: int) -> tuple[Any, list[int]]:
    if vtype == _STRING:
        return cur.string(), [vtype]
    if vtype in _SCALARS:
        return cur.scalar(_SCALARS[vtype]), [vtype]
    if vtype != _ARRAY:
        raise ValueError(f"unknown metadata value type {vtype}")
    etype, count = cur.scalar("<I"), cur.scalar("<Q")
    if etype == _STRING:
        return cur.strings(count), [vtype, etype]
    if etype in _NUMPY:
        dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
        start = cur.take(count * dtype.itemsize)
        values = np.frombuffer(cur.buf, dtype, count, start)
        return values.tolist(), [vtype, etype]
    if etype == _ARRAY:   # arrays of arrays: nested lists
        return [_value(cur, _ARRAY)[0] for _ in range(count)], [vtype, etype]
    raise ValueError(f"unknown metadata array element type {etype}")


def metadata_field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of a metadata key of a parsed header (strings and arrays decoded), or
    `default`."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse the file's header; tensors are views of a copy-on-write map of the file."""
    import gguf   # the value/tensor type enums and block sizes (no parsing)
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    if mapped is None:
        raise ModelLoadError(f"{p} is not a GGUF file: it is empty")
    buf = memoryview(mapped)
    cur = _Cursor(buf)
    try:
        if bytes(buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{p} is not a GGUF file: bad magic {bytes(buf[:4])!r} "
                                 "(expected b'GGUF')")
        cur.take(4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"GGUF file {p}: version {version} is not supported (2 and 3 "
                                 "are; a big-endian file shows a huge version)")
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            key = cur.string()
            value, types = _value(cur, cur.scalar("<I"))
            fields[key] = GGUFField(key, value, [gguf.GGUFValueType(t) for t in types])
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    except _Truncated:
        raise ModelLoadError(f"cannot read GGUF file {p} ({size} bytes): it is truncated "
                             "inside its header") from None
    except ValueError as exc:
        raise ModelLoadError(f"cannot read GGUF file {p}: its header is damaged: {exc}") from exc
    align_field = fields.get("general.alignment")
    align = int(align_field.value) if align_field is not None else DEFAULT_ALIGNMENT
    if align <= 0 or align & (align - 1):
        raise ModelLoadError(f"GGUF file {p}: general.alignment {align} is not a power of two")
    data_start = -(-cur.pos // align) * align
    whole = np.frombuffer(mapped, dtype=np.uint8)
    tensors = [_tensor(p, size, whole, data_start, *info) for info in infos]
    return GGUFContents(p, version, fields, tensors)


def _tensor(p: Path, size: int, whole: np.ndarray, data_start: int, name: str,
            dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
    import gguf
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelLoadError(f"GGUF file {p}: tensor {name!r} has unknown type id "
                             f"{type_id}") from None
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if not dims or dims[0] % block:
        raise ModelLoadError(f"GGUF file {p}: tensor {name!r} of type {qtype.name} has shape "
                             f"{list(dims)}, whose first dimension is not a multiple of "
                             f"{block}")
    n_bytes = n_elements // block * type_size
    start = data_start + offset
    if start + n_bytes > size:
        raise ModelLoadError(f"GGUF file {p} is truncated: tensor {name!r} needs bytes "
                             f"{start}..{start + n_bytes}, the file has {size}")
    raw = whole[start:start + n_bytes]
    outer = tuple(reversed(dims[1:]))
    if type_id in _DENSE:
        data = raw.view(_DENSE[type_id]).reshape(*outer, dims[0])
    else:
        data = raw.reshape(*outer, dims[0] // block * type_size)
    return GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, data)
