"""specdec's q4 matmul (q4_gemm.c, the `q4` format): the numbers of its definition (4-bit weights with a
scale and minimum per 32, int8 activations per 32) up to float rounding; each token's output bit for bit
the same whatever else is in the call, on every code path (AMX, VNNI, AVX2), which agree bit for bit; the layout kept
exactly; and one line saying what to use instead where it cannot run. Each for both layouts: q4's own
(Q4Linear) and a .gguf's Q4_K blocks as they are (Q4KLinear: d·sc and −dmin·m made in the kernel)."""

import copy
import os

import pytest
import torch

from specdec_cli.errors import ModelLoadError
from specdec_cli.models.formats import q4
from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear
from specdec_cli.models.formats.quant import check_quantization, linear_bytes
from specdec_cli.models.native import binding

# In CI these run even where the kernel does not build, and fail: CI's machine must build it.
needs_kernel = pytest.mark.skipif(q4.kernel_problem() is not None and not os.environ.get("CI"),
                                  reason=f"specdec's q4 kernel does not run here: {q4.kernel_problem()}")
# Odd shapes on purpose: rows not a multiple of 16, widths not a multiple of 32; 1100 channels = 35 groups,
# past one 32-group chunk of the many-token path.
SHAPES = [(37, 18), (64, 100), (200, 131), (8, 7), (48, 1100)]
TOKEN_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 33]  # each few-token case; AMX (if any) from 9
# Layout 1's widths are whole Q4_K superblocks of 256; 1280 channels = 40 groups, past one 32-group chunk.
K_SHAPES = [(256, 37), (768, 200), (512, 8), (1280, 48)]
LAYOUTS = ["q4", "q4k"]


def _q4k_layer(in_features: int, out_features: int, bias: bool = False, seed: int = 0) -> Q4KLinear:
    """A layer of random Q4_K parts: levels 0..15, sc and m 0..63, d and dmin of a trained layer's size."""
    generator = torch.Generator().manual_seed(seed)
    groups, supers = in_features // 32, in_features // 256

    def bytes_(shape, top):
        return torch.randint(0, top, shape, generator=generator, dtype=torch.uint8)

    d, dmin = ((torch.rand(out_features, supers, generator=generator) * 2e-3).half() for _ in range(2))
    return Q4KLinear.from_k_parts(bytes_((out_features, in_features), 16), bytes_((out_features, groups), 64),
                                  bytes_((out_features, groups), 64), d, dmin,
                                  torch.randn(out_features, generator=generator) if bias else None, in_features)


def _layer(layout: str, in_features: int, out_features: int, bias: bool = False, seed: int = 0) -> Q4Linear:
    if layout == "q4k":
        return _q4k_layer(in_features, out_features, bias, seed)
    torch.manual_seed(seed)
    return Q4Linear.from_linear(torch.nn.Linear(in_features, out_features, bias=bias))


def _shapes(layout: str) -> list[tuple[int, int]]:
    return K_SHAPES if layout == "q4k" else SHAPES


LAYOUT_SHAPES = [(layout, *shape) for layout in LAYOUTS for shape in _shapes(layout)]


CODE_PATHS = {"amx": 3, "vnni": 2, "avx2": 1}


@pytest.fixture(params=list(CODE_PATHS))
def code_path(request, monkeypatch):
    """Each ISA: the AVX2 code runs on an AVX512 CPU too (and takes the same 8-bit activations), the VNNI code on
    an AMX one (which takes AMX for 9 tokens or more)."""
    library, isa, _ = binding.library()
    if isa < CODE_PATHS[request.param]:
        pytest.skip(f"this CPU has no {request.param.upper()}")
    monkeypatch.setattr(binding, "library", lambda: (library, CODE_PATHS[request.param], None))
    return request.param


def _reference(layer: Q4Linear, x: torch.Tensor) -> torch.Tensor:
    """The definition in float64: x quantised per token and group of 32 (scale amax/127), times the
    dequantised weight, + bias."""
    tokens, width = x.shape
    groups = -(-width // q4.GROUP)
    padded = torch.zeros(tokens, groups * q4.GROUP)
    padded[:, :width] = x
    grouped = padded.view(tokens, groups, q4.GROUP)
    scales = grouped.abs().amax(dim=-1, keepdim=True) / 127
    values = torch.where(scales > 0, torch.round(grouped / scales.clamp_min(1e-30)), 0.0).clamp(-127, 127)
    dequantised = (values * scales).view(tokens, -1)[:, :width].double()
    out = dequantised @ layer.dequantized_weight().double().T
    return out if layer.bias is None else out + layer.bias.double()


def _inputs(tokens: int, width: int) -> torch.Tensor:
    return torch.randn(tokens, width) * torch.logspace(-2, 1, tokens)[:, None]  # rows of unlike scales


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("layout", "in_features", "out_features"), LAYOUT_SHAPES)
def test_the_kernel_computes_its_definition(code_path, layout, in_features, out_features, bias):
    layer = _layer(layout, in_features, out_features, bias, seed=in_features * out_features)
    for tokens in TOKEN_COUNTS:
        x = _inputs(tokens, in_features)
        reference = _reference(layer, x)
        error = (layer(x).double() - reference).abs().amax()
        assert error <= 1e-5 * (1 + reference.abs().amax()), (tokens, code_path, float(error))


@needs_kernel
@pytest.mark.parametrize(("layout", "in_features", "out_features"), LAYOUT_SHAPES)
def test_a_tokens_output_does_not_depend_on_the_others(code_path, layout, in_features, out_features):
    layer = _layer(layout, in_features, out_features, seed=5)
    x = _inputs(40, in_features)  # 5 tiles of 8 tokens: the many-token path
    together = layer(x)
    for tokens in TOKEN_COUNTS:
        assert torch.equal(layer(x[:tokens]), together[:tokens]), tokens
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(40)]), together)


@needs_kernel
@pytest.mark.parametrize(("faster", "slower"), [("vnni", "avx2"), ("amx", "vnni")])
@pytest.mark.parametrize(("layout", "width"), [("q4", 1100), ("q4k", 1280)])
def test_the_code_paths_agree_bit_for_bit(monkeypatch, faster, slower, layout, width):
    library, isa, _ = binding.library()
    if isa < CODE_PATHS[faster]:
        pytest.skip(f"this CPU has no {faster.upper()}")
    layer = _layer(layout, width, 70, bias=True, seed=11)
    x = _inputs(40, width)
    monkeypatch.setattr(binding, "library", lambda: (library, CODE_PATHS[faster], None))
    on_faster = [layer(x[:tokens]) for tokens in [*TOKEN_COUNTS, 40]]
    monkeypatch.setattr(binding, "library", lambda: (library, CODE_PATHS[slower], None))
    assert all(torch.equal(layer(x[:tokens]), out) for tokens, out in zip([*TOKEN_COUNTS, 40], on_faster))


@needs_kernel
@pytest.mark.parametrize(("layout", "width"), [("q4", 1100), ("q4k", 1280)])
def test_weight_blocks_taken_two_at_a_time_give_the_same_bits(code_path, layout, width):
    """Pairs (q4_gemm.c: two blocks' groups alternating, each into sums of its own) are a speed choice per machine;
    every few-token forward (odd rows: the last block alone) must give what one block at a time gives."""
    layer = _layer(layout, width, 70, bias=True, seed=13)
    x = _inputs(40, width)
    before = binding.q4_pairs()
    try:
        binding.pair_q4_blocks(0)
        alone = [layer(x[:tokens]) for tokens in TOKEN_COUNTS]
        binding.pair_q4_blocks(8)
        assert binding.q4_pairs() == 8
        paired = [layer(x[:tokens]) for tokens in TOKEN_COUNTS]
    finally:
        binding.pair_q4_blocks(before)
    for tokens, one, two in zip(TOKEN_COUNTS, alone, paired):
        assert torch.equal(one, two), (tokens, code_path)


@needs_kernel
def test_the_layer_takes_a_models_batch_and_dtype_shapes():
    layer = Q4Linear.from_linear(torch.nn.Linear(64, 40))
    x = torch.randn(2, 3, 64)
    out = layer(x.to(torch.bfloat16))
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    assert torch.equal(layer(x)[1], layer(x[1]))
    assert layer(torch.randn(0, 64)).shape == (0, 40)


@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_packing_keeps_every_value_and_the_byte_count_is_exact(rows, width):
    torch.manual_seed(rows + width)
    weight = torch.randn(rows, width) * torch.logspace(-3, 0, rows)[:, None]
    levels, scales, minimums = q4.quantize_weight(weight)
    packed = q4.pack(levels, scales, minimums)
    for kept, taken in zip(q4.unpack(packed, rows), (levels, scales, minimums)):
        assert torch.equal(kept, taken)
    assert packed.numel() == q4.packed_bytes(rows, width) == linear_bytes("q4", width, rows, torch.float32)


@pytest.mark.parametrize(("width", "rows"), K_SHAPES)
def test_layout_1_keeps_every_part_and_reads_7_5_percent_fewer_bytes(width, rows):
    layer = _q4k_layer(width, rows, seed=rows)
    levels, sub_scales, sub_minimums, d, dmin = parts = layer.k_parts()
    assert levels.shape == (rows, width) and sub_scales.shape == (rows, width // 32) and d.shape == (rows, width // 256)
    assert torch.equal(q4.pack_k(*parts), layer.packed_weight)
    padded = -(-rows // 16) * 16
    assert layer.packed_weight.numel() == padded * width * 37 // 64 == q4.packed_bytes(rows, width) * 37 // 40
    # the weights: step d·sc and minimum −dmin·m, per group of 32
    steps = d.float().repeat_interleave(8, dim=1) * sub_scales.float()
    minimums = -dmin.float().repeat_interleave(8, dim=1) * sub_minimums.float()
    expected = levels.float().view(rows, -1, 32) * steps[..., None] + minimums[..., None]
    assert torch.equal(layer.dequantized_weight(), expected.view(rows, width))


def _awkward_weight(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of unlike scales, and rows that test the edges: constant (a zero step), zeros, ranges whose float16
    step is subnormal or rounds to 0, values past float16's range (an infinite minimum)."""
    weight = torch.randn(rows, width) * torch.logspace(-3, 0, rows)[:, None]
    edges = [torch.full((width,), 0.37), torch.zeros(width), torch.randn(width) * 1e-6, torch.randn(width) * 1e-9,
             torch.randn(width) * 1e5]
    for row, values in zip(range(0, rows, 2), edges):
        weight[row] = values
    return weight.to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_the_c_quantiser_packs_what_torch_does_bit_for_bit(rows, width, dtype):
    torch.manual_seed(rows * width)
    weight = _awkward_weight(rows, width, dtype)
    expected = q4.pack(*q4.quantize_weight(weight))
    assert torch.equal(q4.quantize_packed(weight), expected)
    wider = torch.cat([weight, weight[:, :5]], dim=1)[:, :width]  # rows further apart than the width
    assert torch.equal(q4.quantize_packed(wider), expected)


@needs_kernel
@pytest.mark.parametrize("rows", [(32, 48, 16), (37, 16, 21)], ids=["whole blocks", "ragged"])
def test_fused_layers_hold_the_same_bytes_and_give_each_layers_rows(rows):
    """The lean layers fuse q/k/v and gate/up into one layer: by joining whole 16-row blocks where every part has
    them, else by unpacking and packing again; either way the bytes of packing the rows together."""
    from specdec_cli.models.runtime.lean_layers import fused as fuse

    torch.manual_seed(sum(rows))
    parts = [Q4Linear.from_linear(torch.nn.Linear(70, count)) for count in rows]
    fused = fuse(parts)
    together = [torch.cat(tensors) for tensors in zip(*(q4.unpack(part.packed_weight, part.out_features) for part in parts))]
    assert torch.equal(fused.packed_weight, q4.pack(*together)) and fused.out_features == sum(rows)
    x = torch.randn(3, 70)
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=1))


@needs_kernel
@pytest.mark.parametrize("rows", [(32, 48, 16), (37, 16, 21)], ids=["whole blocks", "ragged"])
def test_fused_q4k_layers_stay_q4k_and_give_each_layers_rows(rows):
    from specdec_cli.models.runtime.lean_layers import fused as fuse

    parts = [_q4k_layer(256, count, bias=index == 1, seed=index) for index, count in enumerate(rows)]
    fused = fuse(parts)
    assert type(fused) is Q4KLinear and fused.out_features == sum(rows)
    together = [torch.cat(tensors) for tensors in zip(*(part.k_parts() for part in parts))]
    assert all(torch.equal(kept, joined) for kept, joined in zip(fused.k_parts(), together))
    x = torch.randn(3, 256)
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=1))


@needs_kernel
def test_q4k_rows_fused_with_layout_0_rows_go_to_layout_0_steps_rounded_to_float16():
    """A .gguf's Q4_K q and k beside its Q6_K v (requantised to layout 0): one layer in layout 0."""
    from specdec_cli.models.runtime.lean_layers import fused as fuse

    q, v = _q4k_layer(256, 32, seed=1), _layer("q4", 256, 16, seed=2)
    fused = fuse([q, v])
    assert type(fused) is Q4Linear and fused.out_features == 48
    levels, scales, minimums = q4.unpack(fused.packed_weight, 48)
    q_steps = q4.k_steps(*q.k_parts()[1:])
    assert torch.equal(levels[:32], q.k_parts()[0]) and torch.equal(scales[:32], q_steps[0].half())
    assert torch.equal(minimums[:32], q_steps[1].half())
    assert torch.equal(fused.dequantized_weight()[32:], v.dequantized_weight())


def test_each_weight_is_within_half_a_step_of_the_float_one():
    torch.manual_seed(2)
    linear = torch.nn.Linear(100, 24)
    layer = Q4Linear.from_linear(linear)
    _, scales, _ = q4.quantize_weight(linear.weight)
    step = scales.float().repeat_interleave(q4.GROUP, dim=1)[:, :100]
    error = (layer.dequantized_weight() - linear.weight.detach()).abs()
    assert bool((error <= step / 2 + 2e-3 * step.clamp_min(1e-3) + 1e-3 * linear.weight.abs().amax()).all())


@needs_kernel
@pytest.mark.parametrize(("layout", "width"), [("q4", 96), ("q4k", 512)])
def test_selected_rows_score_what_the_whole_layer_scores(layout, width):
    layer = _layer(layout, width, 50, bias=True, seed=4)
    rows = torch.tensor([49, 3, 17, 0, 33])
    x = torch.randn(3, width)
    chosen = layer.select_rows(rows)
    assert type(chosen) is type(layer) and torch.equal(chosen(x), layer(x)[:, rows])
    for outside in (50, -1):
        with pytest.raises(IndexError):
            layer.select_rows(torch.tensor([0, outside]))


@needs_kernel
@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_selecting_rows_moves_each_rows_bytes_whole(rows, width, monkeypatch):
    """Rows picked in C (each row's bytes moved) hold what unpacking, indexing and packing again gives."""
    torch.manual_seed(rows + width)
    layer = Q4Linear.from_linear(torch.nn.Linear(width, rows))
    chosen = torch.randint(0, rows, (rows + 5,))  # out of order, repeated, a ragged last block
    made = layer.select_rows(chosen)
    for outside in (rows, -1):  # refused before the C reads past the layer
        with pytest.raises(IndexError):
            layer.select_rows(torch.tensor([0, outside]))
    library = binding.library()[0]
    monkeypatch.setattr(binding, "library", lambda: (library, 1, "the torch way, for the reference"))
    assert torch.equal(made.packed_weight, layer.select_rows(chosen).packed_weight) and made.out_features == rows + 5
    assert torch.equal(made.bias, layer.bias[chosen])


@needs_kernel
def test_a_copied_layer_gives_the_same_numbers():
    layer = Q4Linear.from_linear(torch.nn.Linear(100, 64))
    x = torch.randn(3, 100)
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))


def test_q4_where_the_kernel_cannot_run_says_what_to_use_instead(monkeypatch):
    monkeypatch.setattr(binding, "library", lambda: (None, 0, "specdec's matmul kernels (int8, q4) did not build "
                                                                   "(no C compiler found: install gcc, or set CC)"))
    with pytest.raises(ModelLoadError) as raised:
        check_quantization("q4", torch.device("cpu"))
    assert raised.value.one_line() == (
        "q4 cannot run on this machine: specdec's matmul kernels (int8, q4) did not build (no C compiler found: "
        "install gcc, or set CC) — use int8 or int4 instead (q4 needs an x86-64 CPU with AVX2 and a C compiler: "
        "gcc, or set CC)"
    )


def _quantised_by_definition(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 values (M, groups*32), scales, scaled sums), as the module defines them: torch's IEEE division and
    round-half-even, so the kernel's bytes must equal these exactly."""
    tokens, width = x.shape
    groups = -(-width // q4.GROUP)
    padded = torch.zeros(tokens, groups * q4.GROUP)
    padded[:, :width] = x
    grouped = padded.view(tokens, groups, q4.GROUP)
    scales = grouped.abs().amax(dim=-1) / 127
    values = torch.where(scales[..., None] > 0, torch.round(grouped / scales[..., None].clamp_min(1e-30)), 0.0)
    values = values.clamp(-127, 127)
    return values.to(torch.int8).view(tokens, -1), scales, values.sum(dim=-1) * scales


@needs_kernel
@pytest.mark.parametrize("width", [1536, 100, 64, 7])
def test_activations_are_quantised_exactly_by_definition(width):
    """The 8-at-a-time code (whole groups) and the scalar one (a row's last partial group) give the definition's
    bytes: ties on .5 rounded to even, an all-zero group, rows of unlike scales."""
    library = binding.library()[0]
    torch.manual_seed(width)
    x = _inputs(9, width)
    x[1, : min(width, 40)] = 0.0  # an all-zero group (and part of the next)
    x[2] = torch.arange(width) % 7 - 3.0  # amax 3: ties where x·127/3 lands on .5
    x[3, :width] = torch.where(torch.arange(width) % 2 == 0, 127.0, -0.5 - torch.arange(width) % 9)  # scale 1: exact .5s
    groups = -(-width // q4.GROUP)
    values = torch.full((9, groups * q4.GROUP), 99, dtype=torch.int8)
    scales, sums = torch.empty(9, groups), torch.empty(9, groups)
    library.specdec_q8_groups(2, x.data_ptr(), 9, width, groups, values.data_ptr(), scales.data_ptr(), sums.data_ptr())
    expected = _quantised_by_definition(x)
    assert torch.equal(values, expected[0])
    assert torch.equal(scales, expected[1])
    assert torch.allclose(sums, expected[2], rtol=0, atol=0)
