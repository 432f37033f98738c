"""A GGUF file's key/value metadata and tensor table, read in one pass.

gguf's ``GGUFReader`` parses every metadata element through a numpy view of
its memory map: 1.8-3.7 s and about 160 MB of objects for the default model's
header (a 49k-token vocabulary and 49k merges), paid by every server,
worker and API process that opens the file. This reads the same header with
``struct`` over one memory map, in about 0.1 s, and keeps
only the decoded values (an array of arrays stays nested, where gguf flattens
it). The format is llama.cpp's ``docs/gguf.md``,
versions 2 and 3, little-endian; the type tables are ``gguf``'s own.

Each tensor's ``data`` is a read-only numpy view of the mapped file in the
layout ``gguf.quants.dequantize`` takes: element-typed for plain float and
integer types, rows of block bytes for quantized ones.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {  # value type -> struct format (little-endian)
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_ELEMENT_TYPES = {  # tensor types stored element by element -> numpy dtype
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    data: np.ndarray


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> decoded value) and ``tensors`` in file order."""

    def __init__(self, path: str | Path) -> None:
        self._offset = 0  # where the header is read next
        try:
            with open(path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, self.tensors = self._read_header()
        except (struct.error, ValueError, IndexError) as exc:
            raise ValueError(f"{Path(path).name}: not a readable GGUF file: {exc}") from None

    def _read_header(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if self._map[:4] != MAGIC:
            raise ValueError("bad magic")
        self._offset = 4
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: {VERSIONS}, little-endian)")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(GGUFValueType(self._scalar("<I")))
        table = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        return metadata, [self._tensor(start, *info) for info in table]

    def _scalar(self, layout: str) -> Any:
        (value,) = struct.unpack_from(layout, self._map, self._offset)
        self._offset += struct.calcsize(layout)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        end = self._offset + length
        if end > len(self._map):
            raise ValueError("a string runs past the end of the file")
        text = self._map[self._offset : end].decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = GGUFValueType(self._scalar("<I")), self._scalar("<Q")
        if item in _SCALARS:
            # numpy reads struct's little-endian format codes as the same dtypes.
            values = np.frombuffer(self._map, np.dtype(_SCALARS[item]), count, self._offset)
            self._offset += values.nbytes
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, GGMLQuantizationType(self._scalar("<I")), self._scalar("<Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int
    ) -> GGUFTensor:
        rows_first = tuple(reversed(dims))
        elements = int(np.prod(dims, dtype=np.int64))
        if kind in _ELEMENT_TYPES:
            dtype, shape, count = np.dtype(_ELEMENT_TYPES[kind]), rows_first, elements
        else:
            block_size, block_bytes = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), elements // block_size * block_bytes
            shape = quant_shape_to_byte_shape(rows_first, kind)
        data = np.frombuffer(self._map, dtype, count, start + at).reshape(shape)
        return GGUFTensor(name, kind, dims, data)
