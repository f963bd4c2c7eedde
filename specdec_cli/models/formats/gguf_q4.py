"""q4 weights straight from a `.gguf` file's 4-bit blocks, where its layers are Q4_0, Q4_1 or Q4_K (most of a
Q4_K_M file's are Q4_K), for the in-place loader (loading/gguf_model.py).

These blocks hold, per 32 channels, exactly what q4 holds: 4-bit levels q with w = step·q + minimum —
- Q4_1: step d and minimum m in float16, q4's own layout: the same weights, bit for bit;
- Q4_0: w = d·(q − 8): step d, minimum −8·d, both exact in float16: the same weights, bit for bit;
- Q4_K (256 channels a block): w = d·sc·q − dmin·m (d, dmin float16 per block; sc, m 6-bit per sub-block of 32):
  kept as they are in q4's layout 1 (q4.Q4KLinear), whose kernel makes the step d·sc and minimum −dmin·m per
  group, each an exact float32 product: the same weights, bit for bit, in fewer bytes than layout 0.
The matmul is q4's own. `element_count` reads a file's tensor table alone (what a float conversion would hold)."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch

from specdec_cli.models.formats.q4 import dequantize, k_steps

# gguf.GGMLQuantizationType: channels a block, bytes a block
Q4_0, Q4_1, Q4_K = 2, 3, 12
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q4_K: (256, 144)}


def _halves(data: np.ndarray, offset: int) -> np.ndarray:
    """(B, 1) float32 of the float16 at byte `offset` of each block."""
    return data[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(B, runs, n) bytes → (B, runs · 2n) levels: each run's low nibbles, then its high ones (ggml's order)."""
    shifted = packed[:, :, None, :] >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(len(packed), -1)


def block_parts(raw: np.ndarray, kind: int) -> tuple[torch.Tensor, ...]:
    """A 4-bit tensor's bytes (N, K/block · block bytes) uint8 → its q4 layer's parts: Q4_0 and Q4_1 layout 0's
    (levels (N, K) uint8, scales and minimums (N, K/32) fp16; w = scale·level + minimum per group of 32), Q4_K
    layout 1's (levels, sc and m (N, K/32) uint8 0..63, d and dmin (N, K/256) fp16; w = d·sc·level − dmin·m)."""
    size, rows = BLOCKS[kind][1], raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)  # a row's blocks in order
    if kind == Q4_K:
        from gguf.quants import Q4_K as Q4KBlocks

        sub_scales, sub_minimums = Q4KBlocks.get_scale_min(blocks[:, 4:16])  # (B, 8) each, 0..63
        levels = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))  # sub-block 2c in run c's low nibbles, 2c+1 high
        per_row = (levels, sub_scales.astype(np.uint8), sub_minimums.astype(np.uint8),
                   _halves(blocks, 0).astype(np.float16), _halves(blocks, 2).astype(np.float16))
        return tuple(torch.from_numpy(np.ascontiguousarray(part).reshape(rows, -1)) for part in per_row)
    steps = _halves(blocks, 0)
    minimums = -8.0 * steps if kind == Q4_0 else _halves(blocks, 2)
    levels = _nibbles(blocks[:, size - 16:].reshape(-1, 1, 16))
    return (torch.from_numpy(levels.reshape(rows, -1)), torch.from_numpy(steps.astype(np.float16).reshape(rows, -1)),
            torch.from_numpy(minimums.astype(np.float16).reshape(rows, -1)))


def parts_weight(kind: int, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(N, K) float32: the weights `block_parts(raw, kind)`'s parts hold."""
    if kind != Q4_K:
        return dequantize(*parts)
    levels, *scales = parts
    return dequantize(levels, *k_steps(*scales))


# Sizes of GGUF's fixed-size metadata value types (gguf.GGUFValueType: 8 is a string, 9 an array).
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Table:
    """A little-endian GGUF file's architecture and tensor table (name → (type, shape, byte offset)), read with
    struct from a memory map. gguf.GGUFReader reads the same table but first makes a numpy view of every metadata
    value (a vocabulary's hundreds of thousands of them); skipping them is what makes this read cheap."""

    def __init__(self, path: Path) -> None:
        import mmap

        with open(path, "rb") as handle:
            self.bytes = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.at = 0
        magic, version, tensor_count, kv_count = self._read("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF v2/v3 file: {path}")
        fields = {}
        for _ in range(kv_count):
            key = self._string()
            fields[key] = self._value(self._read("<I")[0])
        self.architecture = fields.get("general.architecture")
        alignment = fields.get("general.alignment", 32)
        self.tensors = {}
        for _ in range(tensor_count):
            name = self._string()
            dims = self._read(f"<{self._read('<I')[0]}Q")
            kind, offset = self._read("<IQ")
            self.tensors[name] = (kind, tuple(reversed(dims)), offset)  # (rows, ...) as numpy and torch hold it
        self.data_start = -(-self.at // alignment) * alignment

    def _read(self, layout: str):
        values = struct.unpack_from(layout, self.bytes, self.at)
        self.at += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        length = self._read("<Q")[0]
        self.at += length
        return bytes(self.bytes[self.at - length:self.at]).decode("utf-8", "replace")

    def _value(self, kind: int):
        """A metadata value: a string or an integer (as unsigned); None for an array or a float (skipped)."""
        if kind == 8:
            return self._string()
        if kind == 9:
            item_kind, count = self._read("<IQ")
            if item_kind in _VALUE_BYTES:
                self.at += _VALUE_BYTES[item_kind] * count
            else:
                for _ in range(count):
                    self._value(item_kind)
            return None
        size = _VALUE_BYTES[kind]
        self.at += size
        if kind in (6, 12):  # floats: none of them is read here
            return None
        code = {1: "B", 2: "H", 4: "I", 8: "Q"}[size]
        return struct.unpack_from("<" + code, self.bytes, self.at - size)[0]


def element_count(path: Path) -> int:
    """How many numbers a .gguf's tensors hold (what a conversion to safetensors writes, times the dtype's size);
    0 for a file whose table cannot be read."""
    try:
        table = _Table(path)
    except (OSError, ValueError, KeyError, struct.error):
        return 0
    return sum(math.prod(shape) for _, shape, _ in table.tensors.values())
