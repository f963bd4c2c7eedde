"""Levels layers (formats/levels.py) straight from a `.gguf` file's Q8_0, Q6_K, Q5_0 and Q5_K blocks, for the in-place
loader (loading/gguf_model.py): the file's weights bit for bit, each `step·(level − offset) + minimum` —
- Q8_0 (32 channels): w = d·q, q int8: level q + 128, offset 128, step d;
- Q5_0 (32): w = d·(q − 16), q 5-bit: level q, offset 16, step d;
- Q6_K (256; sub-blocks of 16): w = d·sc·(q − 32), sc int8: level q, offset 32, a step d·sc per 16 channels;
- Q5_K (256; sub-blocks of 32): w = d·sc·q − dmin·m, sc and m 6-bit: level q, step d·sc, minimum −dmin·m.
Each keeps the file's own factors (levels.Form.tables): Q8_0 and Q5_0 their float16 d, the K types their sc (and m)
a byte each and d (and dmin) float16 per 256 channels. The kernel makes every step and minimum from them as an exact
float32 product (11-bit float16 by an 8-bit integer), as gguf's own dequantisation makes it, so it multiplies by what
`gguf.quants.dequantize` gives, element for element. The levels are read
from the bytes in gguf's own order (its dequantize_blocks, without the float steps)."""

from __future__ import annotations

import numpy as np
import torch

from specdec_cli.models.formats import levels

# gguf.GGMLQuantizationType: channels a block, bytes a block
Q5_0, Q8_0, Q5_K, Q6_K = 6, 8, 13, 14
BLOCKS = {Q5_0: (32, 22), Q8_0: (32, 34), Q5_K: (256, 176), Q6_K: (256, 210)}


def _halves(data: np.ndarray, offset: int) -> np.ndarray:
    """(B, 1) float16 of the float16 at byte `offset` of each block."""
    return data[:, offset:offset + 2].copy().view(np.float16)


def _shifted(packed: np.ndarray, runs: int, shifts: list[int], mask: int) -> np.ndarray:
    """(B, n) bytes as `runs` runs, each read at every shift in turn → (B, runs · len(shifts) · n/runs) values."""
    moved = packed.reshape(len(packed), runs, 1, -1) >> np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return (moved & np.uint8(mask)).reshape(len(packed), -1)


def _block_levels(blocks: np.ndarray, kind: int) -> tuple[np.ndarray, list[np.ndarray], int]:
    """(levels (B, channels) uint8, the form's tables (B, entries) each (levels.Form.tables), the form): `kind`'s
    blocks."""
    if kind == Q8_0:  # q + 128 as a byte; d as the file has it
        return blocks[:, 2:] ^ np.uint8(0x80), [_halves(blocks, 0)], levels.form_code(1, False, 8, 128, levels.FLOAT16)
    if kind == Q5_0:
        high = (blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
        values = _shifted(blocks[:, 6:], 1, [0, 4], 0x0F) | (high.astype(np.uint8) << np.uint8(4))
        return values, [_halves(blocks, 0)], levels.form_code(1, False, 5, 16, levels.FLOAT16)
    if kind == Q6_K:  # sc int8 per 16 channels, d per 256: step d·sc
        low = _shifted(blocks[:, :128], 2, [0, 4], 0x0F)
        high = _shifted(blocks[:, 128:192], 2, [0, 2, 4, 6], 0x03)
        tables = [blocks[:, 192:208].view(np.int8), _halves(blocks, 208)]
        return low | (high << np.uint8(4)), tables, levels.form_code(2, False, 6, 32, levels.FACTORS)
    from gguf.quants import Q4_K as Q4KBlocks

    sub_scales, sub_minimums = Q4KBlocks.get_scale_min(blocks[:, 4:16])  # (B, 8) each, 0..63
    low = _shifted(blocks[:, 48:], 4, [0, 4], 0x0F)
    high = _shifted(blocks[:, 16:48], 1, list(range(8)), 0x01)
    tables = [sub_scales.astype(np.int8), sub_minimums.astype(np.int8), _halves(blocks, 0), _halves(blocks, 2)]
    return low | (high << np.uint8(4)), tables, levels.form_code(1, True, 5, 0, levels.FACTORS)


def level_parts(raw: np.ndarray, kind: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int]:
    """A tensor's bytes (N, K/block · block bytes) uint8 → (levels (N, K) uint8, the form's tables (N, entries) each,
    the form): LevelsLinear.from_tables' arguments."""
    size, rows = BLOCKS[kind][1], raw.shape[0]
    values, tables, form = _block_levels(np.ascontiguousarray(raw).reshape(-1, size), kind)

    def per_row(part: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(part).reshape(rows, -1))

    return per_row(values), tuple(per_row(table) for table in tables), form
