"""int8 on the CPU: int8 weights with one scale per output channel, activations quantised to int8 on
the fly with one scale per token, int32 accumulation (torch's oneDNN int8 matmul, prepacked weights).

Why one scale per token: with one scale for the whole activation tensor (what torch's deprecated
`quantize_dynamic` does) the logits of a token depend on the other tokens in the same forward, so
verifying k draft tokens in one forward would not give what k one-token forwards give, and a
speculative run of an int8 target would not reproduce that target's own greedy output. Here a row's
quantisation reads that row only and the matmul is exact integer arithmetic, so a layer gives row i
the same output whatever else is in the forward; with attention computed row by row too
(runtime/attention.py), row i of a k-token forward is the one-token forward of token i, bit for bit.

Two matmuls give these numbers, bit for bit alike: specdec's own (the native library, loaded by
native/binding.py, where it builds and the CPU has AVX512-VNNI or AVX2: far less overhead per call, and
that overhead is most of a one-token forward) and torch's oneDNN one (elsewhere). A layer holds the weights
in the layout of the one it runs.

Why not torchao's `Int8DynamicActivationInt8WeightConfig` (also per token): in eager mode on a CPU
with AVX512-VNNI but no AMX, torchao 0.18 recomputes the column sums of every weight on every call
(its u8s8 compensation), which costs far more than the matmul itself; it pays only under torch.compile."""

from __future__ import annotations

import functools

import torch

from specdec_cli.models.native import binding


def activation_bits() -> int:
    """8 on a CPU with VNNI. Without VNNI, x86 sums pairs of uint8×int8 products in int16, which can
    saturate: 7-bit activations (uint8 in 1..127) keep every pair below 2**15."""
    has_vnni = getattr(torch.cpu, "_is_vnni_supported", None)  # private in torch 2.13: absent means "assume not"
    return 8 if has_vnni is not None and has_vnni() else 7


def quantize_rows(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a (M, K) float tensor: (uint8 values offset by the zero point, (M, 1) scales)."""
    limit = 2 ** (bits - 1) - 1  # 127 or 63
    rows = rows.float()
    scales = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / limit  # (M, 1)
    values = torch.round(rows / scales).clamp_(-limit, limit).add_(limit + 1).to(torch.uint8)  # (M, K)
    return values, scales


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float → ((N, K) int8, (N,) float32 scales): per output channel, symmetric, w ≈ scale·value."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # (N,)
    return torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def quantize_weight_fast(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight`, bit for bit, in one pass of C where specdec's kernels run (torch's several passes over
    every weight were most of an int8 load's time)."""
    library, _, problem = binding.library()
    if problem:
        return quantize_weight(weight)
    source, dtype_code = binding.weight_in_kernel_form(weight)
    rows, width = source.shape
    values, scales = torch.empty(rows, width, dtype=torch.int8), torch.empty(rows, dtype=torch.float32)
    library.specdec_int8_quantize(torch.get_num_threads(), source.data_ptr(), dtype_code, rows, width,
                                  source.stride(0), values.data_ptr(), scales.data_ptr())
    return values, scales


class PerTokenInt8Linear(torch.nn.Module):
    """A drop-in for a CPU `nn.Linear`: y = x Wᵀ + b with W in int8 per output channel and x in int8 per token."""

    def __init__(self, weight_int8: torch.Tensor, weight_scales: torch.Tensor, bias: torch.Tensor | None,
                 bits: int | None = None) -> None:
        super().__init__()
        bits = bits or activation_bits()
        if binding.kernel_problem(bits) is None:  # blocks of 32 rows (1 byte per weight, padded) and each row's sum
            packed_weight, row_sums = binding.pack(weight_int8)
        else:  # (K, N) in oneDNN's blocked layout: an opaque tensor, counted as a buffer (1 byte per weight).
            packed_weight, row_sums = torch.ops.onednn.qlinear_prepack(weight_int8.contiguous(), None), None
        self._hold(packed_weight, row_sums, weight_scales, bias, bits, *weight_int8.shape)

    def _hold(self, packed_weight: torch.Tensor, row_sums: torch.Tensor | None, weight_scales: torch.Tensor,
              bias: torch.Tensor | None, bits: int, out_features: int, in_features: int) -> None:
        """Keep a packed weight: specdec's kernel's blocks with their row sums, or oneDNN's (row_sums None)."""
        self.out_features, self.in_features, self.bits = out_features, in_features, bits
        self.own_kernel = row_sums is not None
        self.register_buffer("packed_weight", packed_weight)
        if row_sums is not None:
            self.register_buffer("row_sums", row_sums)
        self.register_buffer("weight_scales", weight_scales.float().contiguous())  # (N,)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._zero_points = torch.zeros(1, dtype=torch.int64)  # symmetric weights

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, bits: int | None = None) -> "PerTokenInt8Linear":
        return cls(*quantize_weight_fast(linear.weight), linear.bias, bits)

    @classmethod
    def from_packed(cls, blocks: torch.Tensor, row_sums: torch.Tensor, weight_scales: torch.Tensor,
                    bias: torch.Tensor | None, bits: int, in_features: int) -> "PerTokenInt8Linear | None":
        """A layer of specdec's kernel's packed weight as `pack` made it (stored_layers.py reads them back), or
        None where that kernel does not run here for `bits`-bit activations."""
        if binding.kernel_problem(bits) is not None:
            return None
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._hold(blocks, row_sums, weight_scales, bias, bits, len(row_sums), in_features)
        return layer

    def int8_weight(self) -> torch.Tensor:
        """(N, K) int8, read back from the packed layout."""
        if self.own_kernel:
            return binding.unpack(self.packed_weight, self.out_features, self.in_features)
        return self.packed_weight.to_dense().t()

    def select_rows(self, rows: torch.Tensor) -> "PerTokenInt8Linear":
        """A layer holding only output rows `rows`: the same int8 values and scales, so the same scores."""
        bias = None if self.bias is None else self.bias[rows]
        return PerTokenInt8Linear(self.int8_weight()[rows], self.weight_scales[rows], bias, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            rows = x.reshape(-1, self.in_features)
            out = binding.matmul(rows if rows.dtype == torch.float32 else rows.float(), self.packed_weight,
                                     self.row_sums, self.weight_scales, self.bias, self.bits)
            return (out if x.dtype == torch.float32 else out.to(x.dtype)).view(*x.shape[:-1], self.out_features)
        values, scales = quantize_rows(x.reshape(-1, self.in_features), self.bits)  # (M, K), (M, 1)
        zero_point = 2 ** (self.bits - 1)
        out = torch.ops.onednn.qlinear_pointwise(
            values, 1.0, zero_point, self.packed_weight, self.weight_scales, self._zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # (M, N): (x_int8 · W_int8) * weight scale, exact int32 sums
        out = out * scales if self.bias is None else torch.addcmul(self.bias, out, scales)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo) -> "PerTokenInt8Linear":  # the packed tensor is opaque: rebuild it
        bias = None if self.bias is None else self.bias.clone()
        return PerTokenInt8Linear(self.int8_weight().clone(), self.weight_scales.clone(), bias, self.bits)

    def extra_repr(self) -> str:
        matmul = "specdec" if self.own_kernel else "oneDNN"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activations=int{self.bits} per token, {matmul} matmul")


def matmul_name() -> str:
    """Which int8 matmul a layer built now runs on this CPU: `specdec AVX512-VNNI`, `specdec AVX2` or `oneDNN`."""
    return binding.kernel_name(activation_bits())


@functools.cache
def int8_kernel_problem() -> str | None:
    """None when an int8 matmul (specdec's own, else torch's oneDNN) runs here; else why not (one probe, cached)."""
    own_problem = binding.kernel_problem(activation_bits())
    if own_problem is not None and not torch.backends.mkldnn.is_available():
        return f"this torch build has no oneDNN, and {own_problem}"
    try:
        layer = PerTokenInt8Linear.from_linear(torch.nn.Linear(32, 8))
        layer(torch.randn(2, 32))
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        return f"torch's oneDNN int8 matmul does not run here ({type(error).__name__})"
    return None


def replace_linears(model: torch.nn.Module, quantised) -> torch.nn.Module:
    """Every nn.Linear to `quantised(linear)`, in place; the rest in float32. A tied output layer gets its own
    quantised copy; the input embedding keeps the float weights. Layers are replaced before the float32
    cast, so a bfloat16 model never exists in float32 whole."""
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, quantised(linear))
    return model.float()
