"""q4 weights straight from a `.gguf` file's 4-bit blocks, where its layers are Q4_0, Q4_1 or Q4_K (most of a
Q4_K_M file's are Q4_K).

Why: a `.gguf` is loaded through a bfloat16 conversion (loading/gguf.py), and q4 then quantised that again onto its own
grid (q4.py: a step and a minimum per 32 channels): the 4-bit values llama.cpp's quantiser chose were replaced by
others, up to half a step away. These blocks hold, per 32 channels,
exactly what q4 holds: 4-bit levels q with w = step·q + minimum —
- Q4_1: step d and minimum m in float16, q4's own layout: the same weights, bit for bit;
- Q4_0: w = d·(q − 8): step d, minimum −8·d, both exact in float16: the same weights, bit for bit;
- Q4_K (256 channels a block): w = d·sc·q − dmin·m (d, dmin float16 per block; sc, m 6-bit per sub-block of 32):
  kept as they are in q4's layout 1 (q4.Q4KLinear), whose kernel makes the step d·sc and minimum −dmin·m per
  group, each an exact float32 product: the same weights, bit for bit, in 7.5% fewer bytes than layout 0.
The matmul is q4's own.

Rows go in the order transformers loads them (llama's q/k rows are stored per head in another order: transformers'
own processing of the file's tensor, applied to a column of row numbers, says which). Safe by construction: each
layer taken from the file is compared, on a sample of rows, with the weight transformers loaded for it (the same
tensor dequantised, rounded to bfloat16 or not); a layer that does not match (a name mapped elsewhere, a processing
that does more than reorder rows) is quantised from the loaded weight as before, as are the file's other types
(Q5_0, Q6_K, Q8_0, ...: more than 4 bits)."""

from __future__ import annotations

import importlib.util
import math
import struct
from pathlib import Path

import numpy as np
import torch

from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear, dequantize, k_steps

# gguf.GGMLQuantizationType: channels a block, bytes a block
Q4_0, Q4_1, Q4_K = 2, 3, 12
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q4_K: (256, 144)}
MATCH = 1e-2  # relative error (Frobenius) a layer taken from the file may have against the loaded weight;
# bfloat16 rounding (8 significant bits) stays below it, a q4 requantisation (half a step) goes above it, and a row
# or tensor in the wrong place is off by about 1


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

    def blocks(self, name: str) -> tuple[np.ndarray, int] | None:
        """A 4-bit tensor's bytes (rows, K/block · block bytes) uint8 straight from the map, and its type; None when
        it is not Q4_0, Q4_1 or Q4_K here."""
        found = self.tensors.get(name)
        if found is None or found[0] not in BLOCKS or len(found[1]) != 2 or found[1][1] % BLOCKS[found[0]][0]:
            return None
        (rows, width), (channels, size) = found[1], BLOCKS[found[0]]
        row_bytes = width // channels * size
        start = self.data_start + found[2]
        if start + rows * row_bytes > len(self.bytes):  # a file cut short
            return None
        data = np.frombuffer(self.bytes, np.uint8, rows * row_bytes, start)
        return data.reshape(rows, row_bytes), found[0]


def element_count(path: Path) -> int:
    """How many numbers a .gguf's tensors hold (what a conversion to safetensors writes, times the dtype's size);
    0 for a file whose table cannot be read."""
    try:
        table = _Table(path)
    except (OSError, ValueError, KeyError, struct.error):
        return 0
    return sum(math.prod(shape) for _, shape, _ in table.tensors.values())


class GgufQ4Source:
    """The 4-bit layers of one `.gguf` file by the name of the module they load into."""

    def __init__(self, path: Path, model: torch.nn.Module) -> None:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self._table = _Table(path)
        arch = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}.get(self._table.architecture)
        if arch is None:
            raise ValueError(f"gguf does not know the architecture {self._table.architecture!r}")
        layers = getattr(model.config, "num_hidden_layers", None)  # a nested (multimodal) config has none here
        if not isinstance(layers, int):
            raise ValueError("the model's config does not say how many layers it has")
        self._names = get_tensor_name_map(arch, layers)
        # What transformers does to each tensor it reads from such a file (llama: reorders q/k rows per head).
        self._processor = TENSOR_PROCESSORS.get(self._table.architecture, TensorProcessor)(config=model.config.to_dict())
        self.taken = 0  # layers given from the file

    def layer(self, module_name: str, linear: torch.nn.Linear) -> Q4Linear | None:
        """The q4 layer for the Linear `module_name` made of the file's 4-bit blocks (a Q4KLinear for Q4_K), or
        None (see `_parts`)."""
        found = self._parts(module_name, linear.weight)
        if found is None:
            return None
        kind, parts = found
        if kind == Q4_K:
            return Q4KLinear.from_k_parts(*parts, linear.bias, linear.in_features)
        return Q4Linear.from_parts(*parts, linear.bias, linear.in_features)

    def _parts(self, module_name: str, weight: torch.Tensor) -> tuple[int, tuple[torch.Tensor, ...]] | None:
        """(the file's type, `block_parts`) for the Linear `module_name` from the file's 4-bit blocks, rows in the
        order transformers loaded them, or None (not Q4_0/Q4_1/Q4_K there, transformers changes more than the rows'
        order, or the values do not match `weight`, the loaded one, on a sample of rows)."""
        gguf_name = self._names.get_name(module_name)
        found = None if gguf_name is None else self._table.blocks(gguf_name + ".weight")
        if found is None:
            return None
        (raw, kind), (channels, size) = found, BLOCKS[found[1]]
        order = self._row_order(gguf_name + ".weight", raw.shape[0])
        if order is None or raw.shape != (weight.shape[0], weight.shape[1] // channels * size) or weight.shape[1] % channels:
            return None
        parts = block_parts(raw if np.array_equal(order, np.arange(len(order))) else raw[order], kind)
        sample = slice(None, None, max(1, weight.shape[0] // 64))  # ~64 rows: one out of place shows
        loaded = weight.detach()[sample].float()
        error = torch.linalg.norm(parts_weight(kind, tuple(part[sample] for part in parts)) - loaded)
        if not error <= MATCH * torch.linalg.norm(loaded):  # NaN too
            return None
        self.taken += 1
        return kind, parts

    def _row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """Which row of the file each loaded row is: transformers' own processing applied to a column of row
        numbers. None where that does more than reorder rows."""
        numbers = np.arange(rows, dtype=np.float64)[:, None]
        try:
            result = self._processor.process(weights=numbers, name=gguf_name, tensor_key_mapping={},
                                             parsed_parameters={"tensors": {}})
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return None
        moved = getattr(result, "weights", None)
        if not isinstance(moved, np.ndarray) or moved.shape != numbers.shape:
            return None
        order = moved[:, 0]
        if not np.array_equal(np.sort(order), numbers[:, 0]):
            return None
        return order.astype(np.int64)


def gguf_q4_source(path: Path | None, model: torch.nn.Module) -> GgufQ4Source | None:
    """The file's 4-bit layers, or None: no file, no gguf package, or a model transformers cannot map (then every
    layer is quantised from the loaded weights)."""
    if path is None or importlib.util.find_spec("gguf") is None:
        return None
    try:
        return GgufQ4Source(path, model)
    except (ImportError, ValueError, KeyError, OSError, struct.error):
        return None
