"""A GGUF file's metadata and tensor table, read with `struct` from one memory map.

`gguf.GGUFReader` builds a numpy view per metadata part: for a vocabulary of tens of
thousands of tokens and merges that was most of a first start's conversion. Here a string
is one `struct.unpack_from` and a slice, so the whole header reads quickly. Tensor data stays
in the memory map (a numpy view per tensor, as the gguf reader gives); `gguf` still names
the quantization types and their block sizes, and dequantizes the types Prelude has no
block code for. Little-endian GGUF v2/v3 only (what llama.cpp has written since 2023).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# scalar value types: struct format by GGUF type id (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# numpy dtypes for arrays of scalars and for unquantized tensors
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost (row length) first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # typed [rows..., K] for plain types, uint8 [rows..., row bytes] for block types


class GgufFile:
    """`fields[key]` is the value (int, float, bool, str, or a list of those); `tensors`
    in file order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (v2 or later)")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(kind), offset))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos]

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._map[start : start + n].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(_SCALARS[kind])[0]

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, start: int) -> GgufTensor:
        rows = tuple(reversed(dims[1:]))
        n = int(np.prod(dims))
        if kind in _PLAIN_TENSORS:
            data = np.frombuffer(self._map, dtype=_PLAIN_TENSORS[kind], count=n, offset=start)
            return GgufTensor(name, dims, kind, data.reshape(*rows, dims[0]))
        block, nbytes = GGML_QUANT_SIZES[kind]
        row_bytes = dims[0] // block * nbytes
        data = np.frombuffer(self._map, dtype=np.uint8, count=n // dims[0] * row_bytes, offset=start)
        return GgufTensor(name, dims, kind, data.reshape(*rows, row_bytes))
