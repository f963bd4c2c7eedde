"""Layers of integer levels with steps, for a .gguf's tensors that q4's 4 bits cannot hold (Q8_0, Q6_K, Q5_0, Q5_K:
formats/gguf_levels.py): w = step·(level − offset) + minimum, levels of 5 or 6 bits (Q5_0, Q5_K; Q6_K) packed as 4
bits and planes of the rest, of 8 bits (Q8_0) a byte each, per row and group of 32 input channels a step (per half of
the group, 16 channels, where the form says two halves) and where the form has them a minimum; the offset a power of
two (or 0) for the whole layer. The steps are stored as the file stores them (`Form.tables`): Q8_0's and Q5_0's
float16 d (FLOAT16), the K types' sc (and m) a byte each and d (and dmin) float16 per 256 channels (FACTORS: the kernel
makes d·sc and −dmin·m); a fused mix of K types their factors per 16 channels (`factor_parts`), any other mix
float32 steps and minimums (FLOAT32). Activations are quantised per token and group of 32 as q4's are, and the
matmul (native/levels_gemm.c, levels_avx2.c) is exact integer sums followed by the same float steps for every token:
a k-token verify gives each token its one-token forward's numbers bit for bit.

Why: these types keep more than 4 bits a weight; requantised to q4 the model is no longer the file's (Q6_K: 7.9%
weight error). Each of them is `step·(level − offset) + minimum` with each step and minimum an exact float32 product
of the file's float16 and 6/8-bit factors, so one layout holds each of them with the file's weights bit for bit and
(close to) the file's bytes a weight, and any mix of them with q4's layers in one fused layer (`general_parts`).

Needs the kernel, as q4 does (formats/q4.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec_cli.models.formats import q4
from specdec_cli.models.native import binding

GROUP, ROWS, VALUE_BYTES = 32, 16, 512  # channels a group, rows a block, a block's group of levels a byte each
SUPER_GROUPS = 8  # groups of a superblock (256 channels): the unit a FACTORS form keeps its d (and dmin) for
FLOAT32, FLOAT16, FACTORS = 0, 1, 2  # how a form stores its steps (and minimums): see Form.tables


class Form(NamedTuple):
    """A layer's form (native/levels_layout.h): a step (and minimum) per 16 channels (halves 2) or 32, minimums
    stored, levels up to 255 (wide), the levels' bits above 4 where they are packed (high_bits 1 or 2; 0: a byte
    each), the offset, and how the steps are stored (`steps`: FLOAT32, FLOAT16 or FACTORS)."""

    halves: int
    minimums: bool
    wide: bool
    high_bits: int
    offset: int
    steps: int

    @property
    def bits(self) -> int:
        """Bits a level may have: 8 (wide), 5 or 6 (packed), else 7 (a byte each, up to 127)."""
        return 8 if self.wide else 4 + self.high_bits if self.high_bits else 7

    @property
    def value_bytes(self) -> int:
        return 256 + 64 * self.high_bits if self.high_bits else VALUE_BYTES

    @property
    def unit_groups(self) -> int:
        """Groups of a unit, the groups whose levels lie together with one table of steps after them."""
        return SUPER_GROUPS if self.steps == FACTORS else 1

    @property
    def tables(self) -> list[tuple[torch.dtype, int]]:
        """(dtype, entries a row) of each per-row table of a unit, in order: FLOAT32 and FLOAT16 the steps per half
        of the group, then as many minimums; FACTORS (a .gguf's K blocks) an int8 factor sc per group's half, as
        many factors m of the minimums, a float16 d, a float16 dmin: step d·sc, minimum −dmin·m."""
        per_half = self.halves * self.unit_groups
        if self.steps != FACTORS:
            dtype = torch.float32 if self.steps == FLOAT32 else torch.float16
            return [(dtype, per_half)] * (1 + self.minimums)
        return [(torch.int8, per_half)] * (1 + self.minimums) + [(torch.float16, 1)] * (1 + self.minimums)

    @property
    def unit_bytes(self) -> int:
        table_bytes = sum(ROWS * entries * dtype.itemsize for dtype, entries in self.tables)
        return self.unit_groups * self.value_bytes + table_bytes


def form_code(halves: int, minimums: bool, bits: int, offset: int, steps: int = FLOAT32) -> int:
    """The kernel's one-int form of levels of `bits` bits: 5 and 6 packed as 4 bits and the rest, 8 wide."""
    high_bits = bits - 4 if bits in (5, 6) else 0
    return (halves == 2) | (minimums << 1) | ((bits == 8) << 2) | (high_bits << 3) | (steps << 5) | (offset << 8)


def form_of(form: int) -> Form:
    """`form_code`'s parts again."""
    return Form(2 if form & 1 else 1, bool(form & 2), bool(form & 4), (form >> 3) & 3, form >> 8, (form >> 5) & 3)


def unit_bytes(form: int) -> int:
    return form_of(form).unit_bytes


def packed_groups(packed: torch.Tensor, form: int) -> int:
    """Groups of 32 input channels a row of a packed weight of `form` holds."""
    return packed.shape[1] * form_of(form).unit_groups


def pack(levels: torch.Tensor, tables: tuple[torch.Tensor, ...], form: int) -> torch.Tensor:
    """The kernel's layout (ceil(N/16) blocks, units, unit bytes) uint8: levels (N, groups·32) uint8 (each below
    2^(4 + high_bits) where high_bits is not 0), then per unit (a group, or FACTORS' superblock of 8) the form's
    tables (`Form.tables`: each (N, units · entries) of its dtype)."""
    shape = form_of(form)
    rows, width = levels.shape
    groups, padded_rows = width // GROUP, -(-rows // ROWS) * ROWS
    padded = torch.zeros(padded_rows, width, dtype=torch.uint8)
    padded[:rows] = levels
    # (blocks, rows, groups, 8 chunks, 4 channels) → (blocks, groups, chunk, row, channel): vpdpbusd's 16 rows × 4
    chunks = padded.view(-1, ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, groups, 8, 64)
    values = chunks.reshape(-1, groups, VALUE_BYTES) if not shape.high_bits else _packed_values(chunks, shape.high_bits)
    units = groups // shape.unit_groups
    values = values.reshape(-1, units, shape.unit_groups * shape.value_bytes)
    return torch.cat([values] + [_block_rows(table, units, padded_rows) for table in tables], dim=-1)


def _packed_values(chunks: torch.Tensor, high_bits: int) -> torch.Tensor:
    """(blocks, groups, 8, 64) levels → (blocks, groups, 256 + 64 · high_bits): the low nibbles as q4 packs them, then
    the planes of the top bits, chunk c's at bit c · high_bits."""
    low = chunks & 0x0F
    planes = torch.zeros(*chunks.shape[:2], high_bits, 64, dtype=torch.uint8)
    for chunk in range(8):
        bit = chunk * high_bits
        planes[:, :, bit // 8] |= (chunks[:, :, chunk] >> 4) << (bit % 8)
    nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)
    return torch.cat([nibbles.flatten(2), planes.flatten(2)], dim=-1)


def _unpacked_values(values: torch.Tensor, high_bits: int) -> torch.Tensor:
    """`_packed_values` undone: (blocks, groups, 256 + 64 · high_bits) → (blocks, groups, 8, 64) levels."""
    nibbles = values[..., :256].reshape(*values.shape[:2], 4, 64)
    chunks = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)
    planes = values[..., 256:].reshape(*values.shape[:2], high_bits, 64)
    for chunk in range(8):
        bit = chunk * high_bits
        chunks[:, :, chunk] |= ((planes[:, :, bit // 8] >> (bit % 8)) & ((1 << high_bits) - 1)) << 4
    return chunks


def _block_rows(per_row: torch.Tensor, units: int, padded_rows: int) -> torch.Tensor:
    """(N, units · entries) of any dtype → (blocks, units, entries · 16 · itemsize) bytes: each entry's 16 rows side
    by side (one vector load)."""
    padded = torch.zeros(padded_rows, per_row.shape[1], dtype=per_row.dtype)
    padded[:per_row.shape[0]] = per_row
    entries = per_row.shape[1] // units
    table = padded.view(-1, ROWS, units, entries).permute(0, 2, 3, 1)  # (blocks, units, entry, row)
    return table.contiguous().view(torch.uint8).reshape(-1, units, entries * ROWS * per_row.element_size())


def unpack(packed: torch.Tensor, form: int, rows: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The (levels, tables) that `pack` took, for the first `rows` rows."""
    blocks, units, _ = packed.shape
    shape = form_of(form)
    groups = units * shape.unit_groups
    values = packed[..., :shape.unit_groups * shape.value_bytes].reshape(blocks, groups, shape.value_bytes)
    chunks = _unpacked_values(values, shape.high_bits) if shape.high_bits else values.reshape(blocks, groups, 8, 64)
    levels = chunks.reshape(blocks, groups, 8, ROWS, 4).permute(0, 3, 1, 2, 4)
    levels = levels.reshape(blocks * ROWS, groups * GROUP)[:rows].contiguous()
    tables, start = [], shape.unit_groups * shape.value_bytes
    for dtype, entries in shape.tables:
        size = entries * ROWS * dtype.itemsize
        table = packed[..., start:start + size].contiguous().view(dtype).reshape(blocks, units, entries, ROWS)
        tables.append(table.permute(0, 3, 1, 2).reshape(blocks * ROWS, units * entries)[:rows].contiguous())
        start += size
    return levels, tuple(tables)


def steps_of(tables: tuple[torch.Tensor, ...], form: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(steps, minimums or None), (N, groups · halves) float32, of a form's tables: what the kernel makes of them,
    each an exact float32 product where they are factors (d·sc, −dmin·m: an 11-bit mantissa by an 8-bit integer)."""
    shape = form_of(form)
    if shape.steps != FACTORS:
        return tables[0].float(), tables[1].float() if shape.minimums else None
    per_super = SUPER_GROUPS * shape.halves
    if not shape.minimums:
        factors, d = tables
        return d.float().repeat_interleave(per_super, dim=1) * factors.float(), None
    factors, minimum_factors, d, dmin = tables
    return (d.float().repeat_interleave(per_super, dim=1) * factors.float(),
            -(dmin.float().repeat_interleave(per_super, dim=1) * minimum_factors.float()))


def dequantize(levels: torch.Tensor, steps: torch.Tensor, minimums: torch.Tensor | None,
               offset: int) -> torch.Tensor:
    """(N, K) float32: step·(level − offset) (exact, as gguf's d·q: the same sign of a zero too), + minimum (one
    rounding, as gguf's d·q − dmin·m has)."""
    halves = steps.shape[1] * GROUP // levels.shape[1]

    def per_channel(table: torch.Tensor) -> torch.Tensor:
        return table.repeat_interleave(GROUP // halves, dim=1)

    weight = (levels.float() - float(offset)) * per_channel(steps)
    return weight if minimums is None else weight + per_channel(minimums)


def general_parts(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Any q4 or levels layer's weights as (levels, steps, minimums, bits a level) of the general form (two halves,
    minimums, offset 0), the same weights bit for bit: what layers of different kinds fused into one take."""
    if isinstance(layer, LevelsLinear):
        levels, steps, minimums = layer.parts()
        shape = form_of(layer.form)
        halves, bits = shape.halves, shape.bits
        if minimums is None:
            minimums = torch.zeros_like(steps)
        if shape.offset:
            minimums = minimums + steps * -float(shape.offset)  # an exact product; a minimum of 0 before it
    elif isinstance(layer, q4.Q4KLinear):
        levels, *scales = layer.k_parts()
        (steps, minimums), halves, bits = q4.k_steps(*scales), 1, 5
    else:
        levels, scales, mins = layer.q4_parts()
        steps, minimums, halves, bits = scales.float(), mins.float(), 1, 5
    if halves == 1:
        steps, minimums = steps.repeat_interleave(2, dim=1), minimums.repeat_interleave(2, dim=1)
    return levels, steps, minimums, bits


def factor_parts(layer: torch.nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int] | None:
    """A .gguf K type's layer (Q4_K, Q5_K, Q6_K) as (levels, the tables of the mixed FACTORS form: sc and m int8 per
    16 channels, d and dmin float16 per 256, bits a level) with the same weights: Q6_K's offset as its minimum
    −(32·d)·sc (32·d exact in float16 where it is below 2048), the others' factors as they are, per half twice. None
    for any other layer (and a Q6_K whose 32·d would not be a float16)."""
    if isinstance(layer, q4.Q4KLinear):
        levels, sub_scales, sub_minimums, d, dmin = layer.k_parts()
        return levels, (*(table.to(torch.int8).repeat_interleave(2, dim=1) for table in (sub_scales, sub_minimums)),
                        d, dmin), 4
    shape = form_of(getattr(layer, "form", 0))
    if not isinstance(layer, LevelsLinear) or shape.steps != FACTORS:
        return None
    levels, tables = layer.tables()
    if shape.minimums:  # Q5_K: a factor per 32 channels, for both halves
        sub_scales, sub_minimums, d, dmin = tables
        return levels, (sub_scales.repeat_interleave(2, dim=1), sub_minimums.repeat_interleave(2, dim=1), d, dmin), 5
    sub_scales, d = tables
    if len(d) and float(d.float().abs().max()) >= 2048:
        return None
    return levels, (sub_scales, sub_scales, d, d * shape.offset), 6


def matmul(x: torch.Tensor, packed: torch.Tensor, form: int, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """(M, K) float32 → (M, N) float32 = x Wᵀ (+ bias), x quantised per token and group of 32: one call into C."""
    library, isa, problem = binding.library()
    if problem:
        raise RuntimeError(f"specdec's levels matmul does not run here: {problem}")
    x = x.contiguous()
    tokens, width = x.shape
    out = torch.empty(tokens, out_features, dtype=torch.float32)
    if tokens == 0:
        return out
    failed = library.specdec_levels_linear(isa, form, torch.get_num_threads(), x.data_ptr(), tokens, width,
                                           packed_groups(packed, form), packed.data_ptr(),
                                           None if bias is None else bias.data_ptr(), out_features, out.data_ptr())
    if failed:
        raise MemoryError(f"specdec's levels matmul could not allocate its buffers for {tokens} tokens")
    return out


class LevelsLinear(torch.nn.Module):
    """A drop-in for a CPU `nn.Linear` holding a .gguf tensor's levels, steps and minimums (see the module)."""

    def __init__(self, packed_weight: torch.Tensor, form: int, bias: torch.Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features, self.form = out_features, in_features, form
        self.register_buffer("packed_weight", packed_weight)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_parts(cls, levels: torch.Tensor, steps: torch.Tensor, minimums: torch.Tensor | None, offset: int,
                   bits: int, bias: torch.Tensor | None, in_features: int) -> LevelsLinear:
        """A layer of levels (N, K) uint8 of `bits` bits (5 to 8), steps and minimums (N, K/32 · halves) float32
        (minimums may be None): the FLOAT32 form."""
        halves = steps.shape[1] * GROUP // levels.shape[1]
        tables = (steps,) if minimums is None else (steps, minimums)
        return cls.from_tables(levels, tables, form_code(halves, minimums is not None, bits, offset), bias,
                               in_features)

    @classmethod
    def from_tables(cls, levels: torch.Tensor, tables: tuple[torch.Tensor, ...], form: int,
                    bias: torch.Tensor | None, in_features: int) -> LevelsLinear:
        """A layer of levels (N, K) uint8 and the tables of `form` (`Form.tables`), as a .gguf's blocks give them
        (formats/gguf_levels.py)."""
        bits = form_of(form).bits
        if len(levels) and int(levels.max()) >> bits:
            raise ValueError(f"a level of {int(levels.max())} does not fit in {bits} bits")
        return cls(pack(levels, tables, form), form, bias, in_features, levels.shape[0])

    def tables(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(levels, the form's tables) of this layer's rows."""
        return unpack(self.packed_weight, self.form, self.out_features)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(levels, steps, minimums) of this layer's rows, the steps and minimums float32."""
        levels, tables = self.tables()
        return levels, *steps_of(tables, self.form)

    def dequantized_weight(self) -> torch.Tensor:
        """(N, K) float32: the weight this layer multiplies by."""
        return dequantize(*self.parts(), form_of(self.form).offset)[:, :self.in_features]

    def select_rows(self, rows: torch.Tensor) -> LevelsLinear:
        """A layer holding only output rows `rows`: the same levels and steps, so the same scores."""
        chosen = rows.to(torch.int64)
        if len(chosen) and not 0 <= int(chosen.min()) <= int(chosen.max()) < self.out_features:
            raise IndexError(f"rows outside 0..{self.out_features - 1}")
        levels, tables = self.tables()
        packed = pack(levels[chosen], tuple(table[chosen] for table in tables), self.form)
        bias = None if self.bias is None else self.bias[chosen]
        return LevelsLinear(packed, self.form, bias, self.in_features, len(chosen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = matmul(rows if rows.dtype == torch.float32 else rows.float(), self.packed_weight, self.form, self.bias,
                     self.out_features)
        return (out if x.dtype == torch.float32 else out.to(x.dtype)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = form_of(self.form)
        stored = ["float32", "float16", "d·sc"][shape.steps]
        return (f"in_features={self.in_features}, out_features={self.out_features}, {shape.bits}-bit levels with "
                f"{stored} steps per {GROUP // shape.halves} channels (offset {shape.offset}"
                f"{', minimums' if shape.minimums else ''}), int8 activations")


def fused(layers: list[torch.nn.Module], bias: torch.Tensor | None) -> LevelsLinear:
    """Levels layers (and q4 ones beside them: a .gguf's Q4_K q and k with its Q6_K v) as one levels layer whose rows
    are theirs side by side, every layer's weights bit for bit (`bias`: theirs joined): their bytes joined where all
    have one form and whole blocks of rows, their parts joined where all have one form, else every layer's parts in
    the form of factors per 16 channels (two halves, minimums: `factor_parts`) where all are .gguf K types, else the
    general form (float32 steps and minimums per 16 channels)."""
    width, forms = layers[0].in_features, {getattr(layer, "form", None) for layer in layers}
    if len(forms) == 1 and None not in forms:
        if all(layer.out_features % ROWS == 0 for layer in layers):
            packed = torch.cat([layer.packed_weight for layer in layers])
            return LevelsLinear(packed, layers[0].form, bias, width, sum(layer.out_features for layer in layers))
        joined = [layer.tables() for layer in layers]
        tables = tuple(torch.cat(table) for table in zip(*(layer_tables for _, layer_tables in joined)))
        levels = torch.cat([layer_levels for layer_levels, _ in joined])
        return LevelsLinear.from_tables(levels, tables, layers[0].form, bias, width)
    factored = [factor_parts(layer) for layer in layers]
    if None not in factored:  # the K types only: their factors, close to their bytes a weight
        tables = tuple(torch.cat(table) for table in zip(*(parts[1] for parts in factored)))
        levels = torch.cat([parts[0] for parts in factored])
        form = form_code(2, True, max(parts[2] for parts in factored), 0, FACTORS)
        return LevelsLinear.from_tables(levels, tables, form, bias, width)
    general = [general_parts(layer) for layer in layers]
    parts = [torch.cat([part[index] for part in general]) for index in range(3)]
    return LevelsLinear.from_parts(*parts, 0, max(part[3] for part in general), bias, width)
