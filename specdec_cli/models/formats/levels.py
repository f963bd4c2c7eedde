"""Layers of integer levels with float32 steps, for a .gguf's tensors that q4's 4 bits cannot hold (Q8_0, Q6_K, Q5_0,
Q5_K: formats/gguf_levels.py): w = step·(level − offset) + minimum, a level a byte (0..255), per row and group of 32
input channels a float32 step (per half of the group, 16 channels, where the form says two halves) and where the form
has them a float32 minimum; the offset a power of two (or 0) for the whole layer. Activations are quantised per token
and group of 32 as q4's are, and the matmul (native/levels_gemm.c, levels_avx2.c) is exact integer sums followed by
the same float steps for every token: a k-token verify gives each token its one-token forward's numbers bit for bit.

Why: these types keep more than 4 bits a weight; requantised to q4 the model is no longer the file's (Q6_K: 7.9%
weight error). Each of them is `step·(level − offset) + minimum` with each step and minimum an exact float32 product
of the file's float16 and 6/8-bit factors, so one layout holds each of them, and any mix of them with q4's layers
in one fused layer (`general_parts`), with the file's weights bit for bit.

Needs the kernel, as q4 does (formats/q4.py)."""

from __future__ import annotations

import torch

from specdec_cli.models.formats import q4
from specdec_cli.models.native import binding

GROUP, ROWS, VALUE_BYTES = 32, 16, 512  # channels a group, rows a block, a block's group of levels


def form_code(halves: int, minimums: bool, wide: bool, offset: int) -> int:
    """The kernel's one-int form (native/levels_layout.h): two halves, minimums stored, levels above 127, offset."""
    return (halves == 2) | (minimums << 1) | (wide << 2) | (offset << 8)


def form_parts(form: int) -> tuple[int, bool, bool, int]:
    """`form_code`'s (halves, minimums, wide, offset) again."""
    return 2 if form & 1 else 1, bool(form & 2), bool(form & 4), form >> 8


def group_bytes(form: int) -> int:
    halves, minimums, _, _ = form_parts(form)
    return VALUE_BYTES + 64 * halves * (1 + minimums)


def pack(levels: torch.Tensor, steps: torch.Tensor, minimums: torch.Tensor | None) -> torch.Tensor:
    """The kernel's layout (ceil(N/16) blocks, groups, group bytes) uint8: levels (N, groups·32) uint8, steps and
    minimums (N, groups·halves) float32 (a row's halves side by side)."""
    rows, width = levels.shape
    groups, padded_rows = width // GROUP, -(-rows // ROWS) * ROWS
    padded = torch.zeros(padded_rows, width, dtype=torch.uint8)
    padded[:rows] = levels
    # (blocks, rows, groups, 8 steps, 4 channels) → (blocks, groups, step, row, channel): vpdpbusd's 16 rows × 4
    values = padded.view(-1, ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, groups, VALUE_BYTES)
    tables = [values] + [_block_rows(table, groups, padded_rows) for table in (steps, minimums) if table is not None]
    return torch.cat(tables, dim=-1)


def _block_rows(per_row: torch.Tensor, groups: int, padded_rows: int) -> torch.Tensor:
    """(N, groups·halves) float32 → (blocks, groups, halves · 64) bytes: each half's 16 rows side by side."""
    padded = torch.zeros(padded_rows, per_row.shape[1], dtype=torch.float32)
    padded[:per_row.shape[0]] = per_row
    halves = per_row.shape[1] // groups
    table = padded.view(-1, ROWS, groups, halves).permute(0, 2, 3, 1)  # (blocks, groups, half, row)
    return table.contiguous().view(torch.uint8).reshape(-1, groups, halves * ROWS * 4)


def unpack(packed: torch.Tensor, form: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The (levels, steps, minimums) that `pack` took, for the first `rows` rows."""
    blocks, groups, _ = packed.shape
    halves, has_minimums, _, _ = form_parts(form)
    values = packed[..., :VALUE_BYTES].reshape(blocks, groups, 8, ROWS, 4).permute(0, 3, 1, 2, 4)
    levels = values.reshape(blocks * ROWS, groups * GROUP)[:rows].contiguous()

    def table(start: int) -> torch.Tensor:
        per_half = packed[..., start:start + halves * ROWS * 4].contiguous().view(torch.float32)
        per_half = per_half.reshape(blocks, groups, halves, ROWS).permute(0, 3, 1, 2)
        return per_half.reshape(blocks * ROWS, groups * halves)[:rows].contiguous()

    minimums = table(VALUE_BYTES + halves * ROWS * 4) if has_minimums else None
    return levels, table(VALUE_BYTES), minimums


def dequantize(levels: torch.Tensor, steps: torch.Tensor, minimums: torch.Tensor | None,
               offset: int) -> torch.Tensor:
    """(N, K) float32: step·(level − offset) (exact, as gguf's d·q: the same sign of a zero too), + minimum (one
    rounding, as gguf's d·q − dmin·m has)."""
    halves = steps.shape[1] * GROUP // levels.shape[1]

    def per_channel(table: torch.Tensor) -> torch.Tensor:
        return table.repeat_interleave(GROUP // halves, dim=1)

    weight = (levels.float() - float(offset)) * per_channel(steps)
    return weight if minimums is None else weight + per_channel(minimums)


def general_parts(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Any q4 or levels layer's weights as (levels, steps, minimums, wide) of the general form (two halves, minimums,
    offset 0), the same weights bit for bit: what layers of different kinds fused into one take."""
    if isinstance(layer, LevelsLinear):
        levels, steps, minimums = layer.parts()
        halves, _, wide, offset = form_parts(layer.form)
        if minimums is None:
            minimums = torch.zeros_like(steps)
        if offset:
            minimums = minimums + steps * -float(offset)  # an exact product; a minimum of 0 before it
    elif isinstance(layer, q4.Q4KLinear):
        levels, *scales = layer.k_parts()
        (steps, minimums), halves, wide = q4.k_steps(*scales), 1, False
    else:
        levels, scales, mins = layer.q4_parts()
        steps, minimums, halves, wide = scales.float(), mins.float(), 1, False
    if halves == 1:
        steps, minimums = steps.repeat_interleave(2, dim=1), minimums.repeat_interleave(2, dim=1)
    return levels, steps, minimums, wide


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
                                           packed.shape[1], packed.data_ptr(),
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
                   wide: bool, bias: torch.Tensor | None, in_features: int) -> LevelsLinear:
        """A layer of levels (N, K) uint8, steps and minimums (N, K/32 · halves) float32 (minimums may be None)."""
        halves = steps.shape[1] * GROUP // levels.shape[1]
        form = form_code(halves, minimums is not None, wide, offset)
        return cls(pack(levels, steps, minimums), form, bias, in_features, levels.shape[0])

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(levels, steps, minimums) of this layer's rows."""
        return unpack(self.packed_weight, self.form, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """(N, K) float32: the weight this layer multiplies by."""
        return dequantize(*self.parts(), form_parts(self.form)[3])[:, :self.in_features]

    def select_rows(self, rows: torch.Tensor) -> LevelsLinear:
        """A layer holding only output rows `rows`: the same levels and steps, so the same scores."""
        chosen = rows.to(torch.int64)
        if len(chosen) and not 0 <= int(chosen.min()) <= int(chosen.max()) < self.out_features:
            raise IndexError(f"rows outside 0..{self.out_features - 1}")
        levels, steps, minimums = self.parts()
        packed = pack(levels[chosen], steps[chosen], None if minimums is None else minimums[chosen])
        bias = None if self.bias is None else self.bias[chosen]
        return LevelsLinear(packed, self.form, bias, self.in_features, len(chosen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = matmul(rows if rows.dtype == torch.float32 else rows.float(), self.packed_weight, self.form, self.bias,
                     self.out_features)
        return (out if x.dtype == torch.float32 else out.to(x.dtype)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        halves, minimums, _, offset = form_parts(self.form)
        return (f"in_features={self.in_features}, out_features={self.out_features}, levels with float32 steps per "
                f"{GROUP // halves} channels (offset {offset}{', minimums' if minimums else ''}), int8 activations")


def fused(layers: list[torch.nn.Module], bias: torch.Tensor | None) -> LevelsLinear:
    """Levels layers (and q4 ones beside them: a .gguf's Q4_K q and k with its Q6_K v) as one levels layer whose rows
    are theirs side by side, every layer's weights bit for bit (`bias`: theirs joined): their bytes joined where all
    have one form and whole blocks of rows, their parts joined where all have one form, else every layer's parts in
    the general form (two halves, minimums)."""
    width, forms = layers[0].in_features, {getattr(layer, "form", None) for layer in layers}
    if len(forms) == 1 and None not in forms:
        if all(layer.out_features % ROWS == 0 for layer in layers):
            packed = torch.cat([layer.packed_weight for layer in layers])
            return LevelsLinear(packed, layers[0].form, bias, width, sum(layer.out_features for layer in layers))
        parts = [None if tensors[0] is None else torch.cat(tensors)
                 for tensors in zip(*(layer.parts() for layer in layers))]
        _, _, wide, offset = form_parts(layers[0].form)
        return LevelsLinear.from_parts(*parts, offset, wide, bias, width)
    general = [general_parts(layer) for layer in layers]
    parts = [torch.cat([part[index] for part in general]) for index in range(3)]
    return LevelsLinear.from_parts(*parts, 0, any(part[3] for part in general), bias, width)
