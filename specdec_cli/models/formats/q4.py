"""q4 on the CPU: 4-bit weights with a float16 scale and minimum per row and group of 32 input channels,
activations quantised to int8 on the fly per token and group of 32 (llama.cpp's Q4_1 × Q8_0 recipe), on
specdec's own matmul (native/q4_gemm.c and q4_avx2.c, q4_amx.c on AMX; built and loaded by native/binding.py).

Why: at 1-8 tokens a forward's cost is reading the weights, and q4 reads 0.625 bytes per weight where
int8 reads 1 (and torchao's int4 needs bfloat16 activations, whose kernel is not flat past 2 tokens).
A token's quantisation reads that token only, and its matmul is exact integer sums followed by the same
float steps whatever else is in the forward, so with attention row by row (runtime/attention.py) a
k-token verify gives each token its one-token forward's logits bit for bit, as int8 does.

A second layout holds a .gguf's Q4_K blocks as they are (Q4KLinear, `pack_k`): the same 4-bit levels per 32
channels, with the file's 6-bit sub-scales and float16 superblock scales, from which the kernel makes each group's
step and minimum: the file's weights bit for bit, in 4.625 bits a weight instead of 5.

Needs the kernel: x86-64 with AVX2 (or AVX512-VNNI) and a C compiler; there is no torch fallback."""

from __future__ import annotations

import functools

import torch

from specdec_cli.models.formats.calibration import calibrated_q4_pairs
from specdec_cli.models.native import binding

GROUP = 32  # input channels per scale and minimum
ROWS = 16  # output rows per packed block
GROUP_BYTES = 320  # per block and group: 16 rows × 32 channels × 4 bits, then 16 scales and 16 minimums (fp16)
LEVELS = 15  # q in 0..15
# Layout 1, a .gguf's Q4_K blocks as they are (Q4KLinear): per block and superblock of 8 groups, the 8 groups' 256
# bytes of values, their 16 rows' 6-bit sc (a byte each), then m, then the 16 rows' d and dmin (fp16).
SUPER_GROUPS = 8
K_SUPER_BYTES = SUPER_GROUPS * (256 + 2 * ROWS) + 2 * 2 * ROWS  # 2368


@functools.cache
def take_calibrated_pairs() -> None:
    """Once per process, before its first q4 layer: q4's matmul takes its weight blocks two at a time up to the size
    `specdec calibrate` measured on this machine for the code that runs here (0, never, where it was not measured)."""
    _, isa, problem = binding.library()
    if problem is None:
        binding.pair_q4_blocks(calibrated_q4_pairs(isa))


def kernel_problem() -> str | None:
    """None when the q4 matmul runs here; else why not (no compiler, not x86-64, no AVX2)."""
    return binding.library()[2]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float → (q (N, groups*32) uint8 in 0..15, scales (N, groups) fp16, minimums (N, groups) fp16),
    w ≈ scale·q + minimum; channels past K are zeros."""
    rows, width = weight.shape
    groups = -(-width // GROUP)
    padded = torch.zeros(rows, groups * GROUP, dtype=torch.float32)
    padded[:, :width] = weight.detach().float()
    grouped = padded.view(rows, groups, GROUP)
    low, high = grouped.amin(dim=-1) + 0.0, grouped.amax(dim=-1) + 0.0  # (N, groups); -0.0 as 0.0, whichever amin took
    scales, minimums = ((high - low) / LEVELS).half(), low.half()
    step, base = scales.float()[..., None], minimums.float()[..., None]
    levels = torch.where(step > 0, torch.round((grouped - base) / step.clamp_min(1e-30)), 0.0)
    return levels.clamp_(0, LEVELS).to(torch.uint8).view(rows, -1), scales, minimums


def dequantize(levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """(N, groups*32) float32 of `quantize_weight`'s three tensors: scale·level + minimum per group."""
    grouped = levels.float().view(levels.shape[0], -1, GROUP)
    return (grouped * scales.float()[..., None] + minimums.float()[..., None]).view(levels.shape[0], -1)


def pack(levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """The kernel's layout (ceil(N/16) blocks, groups, 320) uint8 of `quantize_weight`'s three tensors."""
    padded_rows = -(-levels.shape[0] // ROWS) * ROWS
    return torch.cat([_block_values(levels), _block_rows(scales, padded_rows), _block_rows(minimums, padded_rows)],
                     dim=-1)


def _block_values(levels: torch.Tensor) -> torch.Tensor:
    """(N, groups*32) levels → (blocks, groups, 256) bytes: a block's 16 rows, 4 channels a row side by side."""
    rows, width = levels.shape
    groups, padded_rows = width // GROUP, -(-rows // ROWS) * ROWS
    blocks = padded_rows // ROWS
    padded = torch.zeros(padded_rows, width, dtype=torch.uint8)
    padded[:rows] = levels
    steps = padded.view(blocks, ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)  # (B, G, step, row, channel)
    return (steps[:, :, :4] | (steps[:, :, 4:] << 4)).reshape(blocks, groups, 256)


def _block_rows(per_row: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """(N, groups) → (blocks, groups, 16 · item bytes) bytes: each block's 16 rows side by side."""
    groups = per_row.shape[1]
    padded = torch.zeros(padded_rows, groups, dtype=per_row.dtype)
    padded[:per_row.shape[0]] = per_row
    return padded.view(-1, ROWS, groups).permute(0, 2, 1).contiguous().view(torch.uint8)


def _rows_of_blocks(table: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """`_block_rows` undone: (blocks, groups, 16 · item bytes) bytes → (rows, groups) of `dtype`."""
    blocks, groups = table.shape[:2]
    per_row = table.contiguous().view(dtype)  # (B, G, 16)
    return per_row.permute(0, 2, 1).reshape(blocks * ROWS, groups)[:rows].contiguous()


def _levels_of_blocks(values: torch.Tensor, rows: int) -> torch.Tensor:
    """`_block_values` undone: (blocks, groups, 256) bytes → (rows, groups*32) levels."""
    blocks, groups = values.shape[:2]
    nibbles = values.reshape(blocks, groups, 4, ROWS, 4)
    steps = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # (B, G, 8, row, channel)
    return steps.permute(0, 3, 1, 2, 4).reshape(blocks * ROWS, groups * GROUP)[:rows].contiguous()


def pack_k(levels: torch.Tensor, sub_scales: torch.Tensor, sub_minimums: torch.Tensor, d: torch.Tensor,
           dmin: torch.Tensor) -> torch.Tensor:
    """Layout 1 (ceil(N/16) blocks, groups/8, 2368) uint8 of a Q4_K tensor's parts: levels (N, K) uint8, sc and m
    (N, K/32) uint8 0..63, d and dmin (N, K/256) fp16; w = d·sc·level − dmin·m. K a multiple of 256."""
    padded_rows = -(-levels.shape[0] // ROWS) * ROWS
    supers = levels.shape[1] // (GROUP * SUPER_GROUPS)

    def per_super(table: torch.Tensor) -> torch.Tensor:  # (B, G, n) → (B, supers, 8n): a superblock's groups in a row
        return table.reshape(table.shape[0], supers, -1)

    return torch.cat([per_super(_block_values(levels)), per_super(_block_rows(sub_scales, padded_rows)),
                      per_super(_block_rows(sub_minimums, padded_rows)), _block_rows(d, padded_rows),
                      _block_rows(dmin, padded_rows)], dim=-1)


def unpack_k(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The (levels, sc, m, d, dmin) that `pack_k` took, for the first `rows` rows."""
    blocks, supers, _ = packed.shape
    groups, values = supers * SUPER_GROUPS, SUPER_GROUPS * 256
    table = SUPER_GROUPS * ROWS  # bytes of a superblock's sc (or m)

    def per_group(start: int, size: int) -> torch.Tensor:  # (B, supers, 8·size) → (B, G, size)
        return packed[..., start:start + SUPER_GROUPS * size].reshape(blocks, groups, size)

    return (_levels_of_blocks(per_group(0, 256), rows), _rows_of_blocks(per_group(values, ROWS), torch.uint8, rows),
            _rows_of_blocks(per_group(values + table, ROWS), torch.uint8, rows),
            _rows_of_blocks(packed[..., values + 2 * table:values + 2 * table + 32], torch.float16, rows),
            _rows_of_blocks(packed[..., values + 2 * table + 32:], torch.float16, rows))


def k_steps(sub_scales: torch.Tensor, sub_minimums: torch.Tensor, d: torch.Tensor,
            dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's step d·sc and minimum −dmin·m per row and group, float32: each product exact (11 and 6
    significant bits), as the kernel computes them."""
    return (d.float().repeat_interleave(SUPER_GROUPS, dim=1) * sub_scales.float(),
            -(dmin.float().repeat_interleave(SUPER_GROUPS, dim=1) * sub_minimums.float()))


def quantize_packed(weight: torch.Tensor) -> torch.Tensor:
    """`pack(*quantize_weight(weight))`, bit for bit, in one pass of C over the weight where the kernel runs
    (native/q4_pack.c; torch's eight passes over every weight were most of a q4 load's time)."""
    library, _, problem = binding.library()
    if problem:
        return pack(*quantize_weight(weight))
    source, dtype_code = binding.weight_in_kernel_form(weight)
    rows, width = source.shape
    packed = torch.empty(-(-rows // ROWS), -(-width // GROUP), GROUP_BYTES, dtype=torch.uint8)
    library.specdec_q4_quantize(torch.get_num_threads(), source.data_ptr(), dtype_code, rows, width,
                                source.stride(0), packed.data_ptr())
    return packed


def unpack(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (levels, scales, minimums) that `pack` took, for the first `rows` rows."""
    return (_levels_of_blocks(packed[..., :256], rows), _rows_of_blocks(packed[..., 256:288], torch.float16, rows),
            _rows_of_blocks(packed[..., 288:], torch.float16, rows))


def packed_bytes(rows: int, width: int) -> int:
    """Bytes `pack` makes of a (rows, width) weight: rows padded to 16, width to 32."""
    return -(-rows // ROWS) * -(-width // GROUP) * GROUP_BYTES


def packed_groups(packed: torch.Tensor, layout: int) -> int:
    """How many groups of 32 input channels a packed weight of `layout` holds a row."""
    return packed.shape[1] * (SUPER_GROUPS if layout else 1)


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           layout: int = 0) -> torch.Tensor:
    """(M, K) float32 → (M, N) float32 = x Wᵀ (+ bias), x quantised per token and group of 32; W packed by `pack`
    (layout 0) or `pack_k` (1). One call into C (quantisation and matmul): a layer's Python overhead is a large part
    of a one-token forward."""
    library, isa, problem = binding.library()
    if problem:
        raise RuntimeError(f"specdec's q4 matmul does not run here: {problem}")
    x = x.contiguous()
    tokens, width = x.shape
    out = torch.empty(tokens, out_features, dtype=torch.float32)
    if tokens == 0:
        return out
    failed = library.specdec_q4_linear(isa, layout, torch.get_num_threads(), x.data_ptr(), tokens, width,
                                       packed_groups(packed, layout),
                                       packed.data_ptr(), None if bias is None else bias.data_ptr(), out_features,
                                       out.data_ptr())
    if failed:
        raise MemoryError(f"specdec's q4 matmul could not allocate its buffers for {tokens} tokens")
    return out


class Q4Linear(torch.nn.Module):
    """A drop-in for a CPU `nn.Linear`: y = x Wᵀ + b with W in q4 (see the module) and x in int8 per group."""

    layout = 0  # the kernel's layout of packed_weight (Q4KLinear: 1)

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        take_calibrated_pairs()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed_weight", packed_weight)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_parts(cls, levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                   bias: torch.Tensor | None, in_features: int) -> "Q4Linear":
        """A layer of `quantize_weight`'s three tensors."""
        return cls(pack(levels, scales, minimums), bias, in_features, levels.shape[0])

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Q4Linear":
        return cls(quantize_packed(linear.weight), linear.bias, linear.in_features, linear.out_features)

    def select_rows(self, rows: torch.Tensor) -> "Q4Linear":
        """A layer holding only output rows `rows`: the same 4-bit values and scales, so the same scores. Each
        row's bytes are moved whole in C where the kernel runs (the draft's subset head of 65,536 rows is taken at
        every load, and unpacking and packing them in torch cost far more)."""
        bias = None if self.bias is None else self.bias[rows]
        library, _, problem = binding.library()
        if problem:
            levels, scales, minimums = unpack(self.packed_weight, self.out_features)
            return Q4Linear.from_parts(levels[rows], scales[rows], minimums[rows], bias, self.in_features)
        chosen = self._rows_within(rows)
        groups = self.packed_weight.shape[1]
        packed = torch.zeros(-(-len(chosen) // ROWS), groups, GROUP_BYTES, dtype=torch.uint8)
        library.specdec_q4_select_rows(torch.get_num_threads(), self.packed_weight.data_ptr(), groups,
                                       chosen.data_ptr(), len(chosen), packed.data_ptr())
        return Q4Linear(packed, bias, self.in_features, len(chosen))

    def _rows_within(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` as int64, refused (IndexError) where one is not a row of this layer."""
        chosen = rows.to(torch.int64).contiguous()
        if len(chosen) and not 0 <= int(chosen.min()) <= int(chosen.max()) < self.out_features:
            raise IndexError(f"rows outside 0..{self.out_features - 1}")
        return chosen

    def q4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(levels, scales, minimums) of layout 0 (`quantize_weight`'s three tensors) for this layer's rows."""
        return unpack(self.packed_weight, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """(N, K) float32: the weight this layer multiplies by."""
        return dequantize(*self.q4_parts())[:, :self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = matmul(rows if rows.dtype == torch.float32 else rows.float(), self.packed_weight, self.bias,
                     self.out_features, self.layout)
        return (out if x.dtype == torch.float32 else out.to(x.dtype)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"q4 weights (groups of {GROUP}), int8 activations per group, specdec matmul")


class Q4KLinear(Q4Linear):
    """A q4 layer holding a .gguf's Q4_K blocks as they are (layout 1, `pack_k`): per 32 channels the same 4-bit
    levels, with the step d·sc and minimum −dmin·m made in the kernel from the file's 6-bit sc, m and float16 d,
    dmin per 256. So it multiplies by the file's weights bit for bit, and reads 4.625 bits a weight where layout 0 reads
    5 (7.5% fewer bytes a forward). Its input width is a multiple of 256."""

    layout = 1

    @classmethod
    def from_k_parts(cls, levels: torch.Tensor, sub_scales: torch.Tensor, sub_minimums: torch.Tensor, d: torch.Tensor,
                     dmin: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> "Q4KLinear":
        """A layer of `pack_k`'s five tensors."""
        return cls(pack_k(levels, sub_scales, sub_minimums, d, dmin), bias, in_features, levels.shape[0])

    def k_parts(self) -> tuple[torch.Tensor, ...]:
        """(levels, sc, m, d, dmin) of this layer's rows."""
        return unpack_k(self.packed_weight, self.out_features)

    def q4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layout 0's parts of the same weights, the step and minimum rounded to float16 (for a layer that joins
        layout-0 rows: up to 2⁻¹¹ of (15·step + |minimum|) off the file's weights)."""
        levels, *scales = self.k_parts()
        steps, minimums = k_steps(*scales)
        return levels, steps.half(), minimums.half()

    def dequantized_weight(self) -> torch.Tensor:
        levels, *scales = self.k_parts()
        return dequantize(levels, *k_steps(*scales))[:, :self.in_features]

    def select_rows(self, rows: torch.Tensor) -> "Q4KLinear":
        """A layer holding only output rows `rows`, in layout 1: the same values, so the same scores."""
        chosen = self._rows_within(rows)
        bias = None if self.bias is None else self.bias[chosen]
        return Q4KLinear.from_k_parts(*(part[chosen] for part in self.k_parts()), bias, self.in_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", a .gguf's Q4_K blocks as they are"


