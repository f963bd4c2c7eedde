"""Levels layers (formats/levels.py) straight from a `.gguf` file's Q8_0, Q6_K, Q5_0 and Q5_K blocks, for the in-place
loader (loading/gguf_model.py): the file's weights bit for bit, each `step·(level − offset) + minimum` —
- Q8_0 (32 channels): w = d·q, q int8: level q + 128, offset 128, step d;
- Q5_0 (32): w = d·(q − 16), q 5-bit: level q, offset 16, step d;
- Q6_K (256; sub-blocks of 16): w = d·sc·(q − 32), sc int8: level q, offset 32, a step d·sc per 16 channels;
- Q5_K (256; sub-blocks of 32): w = d·sc·q − dmin·m, sc and m 6-bit: level q, step d·sc, minimum −dmin·m.
Every step and minimum is an exact float32 product (11-bit float16 by an 8-bit integer), as gguf's own dequantisation
makes it, so the kernel multiplies by what `gguf.quants.dequantize` gives, element for element. The levels are read
from the bytes in gguf's own order (its dequantize_blocks, without the float steps)."""

from __future__ import annotations

import numpy as np
import torch

# gguf.GGMLQuantizationType: channels a block, bytes a block
Q5_0, Q8_0, Q5_K, Q6_K = 6, 8, 13, 14
BLOCKS = {Q5_0: (32, 22), Q8_0: (32, 34), Q5_K: (256, 176), Q6_K: (256, 210)}


def _halves(data: np.ndarray, offset: int) -> np.ndarray:
    """(B, 1) float32 of the float16 at byte `offset` of each block."""
    return data[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _shifted(packed: np.ndarray, runs: int, shifts: list[int], mask: int) -> np.ndarray:
    """(B, n) bytes as `runs` runs, each read at every shift in turn → (B, runs · len(shifts) · n/runs) values."""
    moved = packed.reshape(len(packed), runs, 1, -1) >> np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return (moved & np.uint8(mask)).reshape(len(packed), -1)


def _block_levels(blocks: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """(levels (B, channels) uint8, steps (B, sub-blocks) float32, minimums or None, offset, bits a level): `kind`'s
    blocks."""
    if kind == Q8_0:
        return blocks[:, 2:] ^ np.uint8(0x80), _halves(blocks, 0), None, 128, 8  # q + 128 as a byte
    if kind == Q5_0:
        high = (blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
        levels = _shifted(blocks[:, 6:], 1, [0, 4], 0x0F) | (high.astype(np.uint8) << np.uint8(4))
        return levels, _halves(blocks, 0), None, 16, 5
    if kind == Q6_K:
        low = _shifted(blocks[:, :128], 2, [0, 4], 0x0F)
        high = _shifted(blocks[:, 128:192], 2, [0, 2, 4, 6], 0x03)
        steps = _halves(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # d·sc per 16
        return low | (high << np.uint8(4)), steps, None, 32, 6
    from gguf.quants import Q4_K as Q4KBlocks

    sub_scales, sub_minimums = Q4KBlocks.get_scale_min(blocks[:, 4:16])  # (B, 8) each, 0..63
    low = _shifted(blocks[:, 48:], 4, [0, 4], 0x0F)
    high = _shifted(blocks[:, 16:48], 1, list(range(8)), 0x01)
    steps = _halves(blocks, 0) * sub_scales.astype(np.float32)
    minimums = -(_halves(blocks, 2) * sub_minimums.astype(np.float32))
    return low | (high << np.uint8(4)), steps, minimums, 0, 5


def level_parts(raw: np.ndarray, kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """A tensor's bytes (N, K/block · block bytes) uint8 → (levels (N, K) uint8, steps (N, K/32 · halves) float32,
    minimums (N, K/32) float32 or None, offset, bits a level): LevelsLinear.from_parts' arguments."""
    size, rows = BLOCKS[kind][1], raw.shape[0]
    levels, steps, minimums, offset, bits = _block_levels(np.ascontiguousarray(raw).reshape(-1, size), kind)

    def per_row(part: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(part).reshape(rows, -1))

    return per_row(levels), per_row(steps), None if minimums is None else per_row(minimums), offset, bits
