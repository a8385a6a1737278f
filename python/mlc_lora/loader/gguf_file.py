"""A GGUF file's header (key-values and tensor table) parsed in one pass, tensors memory-mapped.

gguf-py's GGUFReader builds a numpy view per array element (seconds for a 49k-token vocabulary);
this reads the same layout with struct over an mmap and leaves the tensor bytes on disk until asked for.
Layout: magic "GGUF", version, tensor count, kv count, kvs, tensor infos, padding to
general.alignment (32), tensor data. Little-endian only.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelConfigError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


@dataclasses.dataclass
class GGUFTensor:
    """One entry of the tensor table; `data` is the raw bytes shaped (*dims[::-1][:-1], row bytes)."""

    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dim first
    tensor_type: Any  # gguf.GGMLQuantizationType
    offset: int
    n_bytes: int
    _file: np.ndarray  # the whole mapped file as uint8

    @property
    def data(self) -> np.ndarray:
        raw = self._file[self.offset:self.offset + self.n_bytes]
        np_dims = tuple(reversed(self.shape))
        return raw.reshape(*np_dims[:-1], -1) if np_dims else raw


@dataclasses.dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as e:
            raise ModelConfigError(f"{self.path} is not a readable GGUF file: truncated header") from e
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ModelConfigError(f"{self.path} is not a readable GGUF file: truncated header")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if itype == _STRING:
                return [self.string() for _ in range(n)]
            if itype == _ARRAY or itype not in _NUMPY:
                raise ModelConfigError(f"{self.path}: unsupported GGUF array element type {itype}")
            dt = np.dtype(_NUMPY[itype])
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
            self.pos += n * dt.itemsize
            return arr.tolist()
        if vtype not in _SCALARS:
            raise ModelConfigError(f"{self.path}: unknown GGUF value type {vtype}")
        v = self.unpack(_SCALARS[vtype])
        # float32 metadata (eps, rope base) as the decimal it was written from: 1e-05, not 9.99e-06
        return float(str(np.float32(v))) if vtype == _FLOAT32 else v


def read_gguf(path: str | Path) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # pylint: disable=import-outside-toplevel

    path = Path(path)
    # mmap, not np.memmap: slicing it gives bytes, where every np.memmap view costs microseconds
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path} is not a readable GGUF file: {e}") from e
    cur = _Cursor(mm, path)
    if mm[:4] != b"GGUF":
        raise ModelConfigError(f"{path} is not a readable GGUF file: no GGUF magic at its start")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelConfigError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                               "big-endian files are not)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        raw_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise ModelConfigError(f"{path}: tensor {name!r} has unknown GGML type {raw_type}") from e
        infos.append((name, dims, qtype, offset))
    data = np.frombuffer(mm, dtype=np.uint8)
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise ModelConfigError(f"{path}: tensor {name!r} rows ({dims[0]}) are not whole {qtype.name} blocks")
        n_bytes = n_elems // block * type_size
        if start + offset + n_bytes > len(mm):
            raise ModelConfigError(f"{path} is truncated: tensor {name!r} lies past the end of the file")
        if name in tensors:
            raise ModelConfigError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = GGUFTensor(name, dims, qtype, start + offset, n_bytes, data)
    return GGUFFile(path, version, meta, tensors)
