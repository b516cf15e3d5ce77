"""The tensors of a GGUF file, memory-mapped, without decoding its metadata.

gguf.GGUFReader turns every metadata value into numpy views (the default model's 49152-token
vocabulary and merges take it about 6 s); loading weights needs only the tensor directory, so
this walks past the metadata with struct and maps the tensor data.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC

# Sizes of GGUF's scalar value types; 8 (string) and 9 (array) are variable.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_DEFAULT_ALIGNMENT = 32


class GGUFTensor(NamedTuple):
    """One tensor: shape fastest-first (as GGUF lists it), type, and its bytes as rows."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLType
    data: np.ndarray  # uint8 [rows, bytes per row] of the file's memory map


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> bytes:
        (length,) = self.take("<Q")
        self.at += length
        return bytes(self.buf[self.at - length : self.at])

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            self.string()
        elif value_type == _ARRAY:
            element_type, count = self.take("<IQ")
            if element_type in _SCALAR_SIZES:
                self.at += _SCALAR_SIZES[element_type] * count
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            self.at += _SCALAR_SIZES[value_type]


def read_gguf_tensors(path: Path) -> list[GGUFTensor]:
    """The file's tensors in file order; ValueError for a file that is not GGUF v2/v3."""
    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data.data))
    magic, version, tensor_count, kv_count = cursor.take("<IIQQ")
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF v2/v3 file (magic {magic:#x}, version {version})")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cursor.string()
        (value_type,) = cursor.take("<I")
        if key == b"general.alignment" and value_type == _UINT32:
            (alignment,) = cursor.take("<I")
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string().decode()
        (n_dims,) = cursor.take("<I")
        shape = cursor.take(f"<{n_dims}Q")
        tensor_type, offset = cursor.take("<IQ")
        infos.append((name, shape, GGMLType(tensor_type), offset))
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, shape, tensor_type, offset in infos:
        block, type_size = GGML_QUANT_SIZES[tensor_type]
        row_bytes = shape[0] // block * type_size
        rows = int(np.prod(shape[1:], dtype=np.int64))
        at = start + offset
        tensors.append(
            GGUFTensor(
                name,
                tuple(int(d) for d in shape),
                tensor_type,
                data[at : at + rows * row_bytes].reshape(rows, row_bytes),
            )
        )
    return tensors
