"""The tensors of a `.gguf` file, read from its header without parsing its metadata values.

gguf's own GGUFReader builds a numpy view of every metadata value as it opens a file — a string per token of the
vocabulary and per merge — which took 7.6 s for a Qwen2.5-7B-shaped file's 152,064 tokens and 151,387 merges on an
AMD EPYC here, on every load, for tensors whose places the header gives in a few thousand bytes. This reader steps
over the values (reading only their lengths) and gives each tensor as GGUFReader does: its name, type, shape (the
file's order, first dimension first), the absolute offset and length of its bytes, and `data`, a read-only view of
the memory-mapped file shaped as GGUFReader shapes it (a quantised type's rows of bytes, F16/F32 as their values).

Little-endian files of version 2 and 3 (what llama.cpp writes); anything else is handed to GGUFReader."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# gguf's value types: the fixed sizes, then STRING = 8 and ARRAY = 9
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
_ALIGNMENT_KEY = b"general.alignment"
_ITEM_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class FileTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # the file's order: the first dimension is the one a row runs along
    data_offset: int  # of its bytes in the file
    n_bytes: int
    data: np.ndarray  # a view of the mapped file (see the module)


class _Cursor:
    """Reads the header through the file's mmap (struct on its bytes: a numpy slice a value is ~20x slower)."""

    def __init__(self, mapped) -> None:
        self.mapped, self.at = mapped, 0

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.mapped):
            raise EOFError("the file ends inside its header")
        part = self.mapped[self.at:self.at + size]
        self.at += size
        return part

    def number(self, form: str) -> int:
        size = struct.calcsize(form)
        if self.at + size > len(self.mapped):
            raise EOFError("the file ends inside its header")
        value = struct.unpack_from("<" + form, self.mapped, self.at)[0]
        self.at += size
        return value

    def string(self) -> bytes:
        return self.take(self.number("Q"))

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.at += _FIXED[kind]
        elif kind == STRING:
            length = self.number("Q")  # read before `at` moves past it (`at += number()` would add to the old `at`)
            self.at += length
        elif kind == ARRAY:
            item, count = self.number("I"), self.number("Q")
            if item in _FIXED:
                self.at += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown metadata value type {kind}")


def tensors(path: Path) -> list:
    """The tensors of the .gguf at `path` (FileTensor; GGUFReader's tensors for a file this reader does not read)."""
    from gguf import GGUFReader

    buffer = np.memmap(path, mode="r")
    cursor = _Cursor(buffer._mmap)
    if cursor.take(4) != b"GGUF" or cursor.number("I") not in (2, 3):
        return GGUFReader(str(path), "r").tensors  # another version or a big-endian file: gguf's own reader
    count, values = cursor.number("Q"), cursor.number("Q")
    alignment = 32
    for _ in range(values):
        key, kind = cursor.string(), cursor.number("I")
        if key == _ALIGNMENT_KEY and kind == 4:
            alignment = cursor.number("I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(count):
        name = cursor.string().decode()
        dims = tuple(cursor.number("Q") for _ in range(cursor.number("I")))
        infos.append((name, dims, cursor.number("I"), cursor.number("Q")))
    start = -(-cursor.at // alignment) * alignment
    return [_tensor(buffer, start, *info) for info in infos]


def _tensor(buffer: np.memmap, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> FileTensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    tensor_type = GGMLQuantizationType(kind)
    block, size = GGML_QUANT_SIZES[tensor_type]
    elements = int(np.prod(dims))
    n_bytes = elements * size // block
    begin = start + offset
    if begin + n_bytes > len(buffer):
        raise EOFError(f"the bytes of {name} run past the end of the file")
    shape = tuple(reversed(dims))
    item = _ITEM_TYPES.get(tensor_type.name)
    if item is None:  # a quantised type: rows of bytes
        data = buffer[begin:begin + n_bytes].reshape(quant_shape_to_byte_shape(shape, tensor_type))
    else:
        data = buffer[begin:begin + n_bytes].view(item).reshape(shape)
    return FileTensor(name, tensor_type, dims, begin, n_bytes, data)
