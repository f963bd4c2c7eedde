"""specdec's levels matmul (native/levels_gemm.c, levels_avx2.c; formats/levels.py) on a .gguf's Q8_0, Q6_K, Q5_0 and
Q5_K blocks (formats/gguf_levels.py): each layer's weights are gguf's own dequantisation bit for bit, the matmul
computes its definition at odd shapes on every code path, each token's output is the same whatever else is in the
call (a verify is one-token decoding), the VNNI and AVX2 code agree bit for bit, and layers of different types fused
into one keep every layer's weights."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec_cli.models.formats import gguf_levels
from specdec_cli.models.formats.levels import LevelsLinear
from specdec_cli.models.formats.q4 import Q4KLinear
from specdec_cli.models.native import binding
from specdec_cli.models.runtime.lean_layers import fused
from tests.tiny import random_blocks

pytest.importorskip("gguf")
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(binding.library()[0] is None, reason=f"no kernels: {binding.library()[2]}")]

TYPES = {"Q8_0": gguf_levels.Q8_0, "Q6_K": gguf_levels.Q6_K, "Q5_0": gguf_levels.Q5_0, "Q5_K": gguf_levels.Q5_K}
# Odd row counts (not a multiple of 16); widths of whole 256-channel blocks (the K types'), 1280 = 40 groups: past
# one 16-group chunk of the many-token path.
SHAPES = [(256, 37), (512, 8), (1280, 21)]
TOKEN_COUNTS = [1, 2, 3, 5, 8, 9, 17]
CODE_PATHS = {"vnni": 2, "avx2": 1}


def _file_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    """The .gguf's own values of a tensor, dequantised by the gguf package (float32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))


def _layer(kind: str, width: int, rows: int, bias: bool = False, seed: int = 0) -> tuple[LevelsLinear, np.ndarray]:
    raw = random_blocks(kind, rows, width, np.random.default_rng(seed))
    biases = torch.randn(rows, generator=torch.Generator().manual_seed(seed)) if bias else None
    return LevelsLinear.from_tables(*gguf_levels.level_parts(raw, TYPES[kind]), biases, width), raw


@pytest.fixture(params=list(CODE_PATHS))
def code_path(request, monkeypatch):
    """Each code path: the AVX2 code runs on an AVX512 CPU too, as q4's tests run it."""
    library, isa, _ = binding.library()
    if isa < CODE_PATHS[request.param]:
        pytest.skip(f"this CPU has no {request.param.upper()}")
    monkeypatch.setattr(binding, "library", lambda: (library, CODE_PATHS[request.param], None))
    return request.param


def _reference(layer: LevelsLinear, x: torch.Tensor) -> torch.Tensor:
    """The definition in float64: x quantised per token and group of 32 (scale amax/127), times the layer's
    weights, + bias."""
    grouped = x.view(x.shape[0], -1, 32)
    scales = grouped.abs().amax(dim=-1, keepdim=True) / 127
    values = torch.where(scales > 0, torch.round(grouped / scales.clamp_min(1e-30)), 0.0).clamp(-127, 127)
    out = (values * scales).view(x.shape).double() @ layer.dequantized_weight().double().T
    return out if layer.bias is None else out + layer.bias.double()


def _inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, width, generator=generator) * torch.logspace(-2, 1, tokens)[:, None]


@pytest.mark.parametrize("kind", list(TYPES))
def test_each_types_layer_holds_ggufs_own_dequantisation_bit_for_bit(kind):
    layer, raw = _layer(kind, 768, 40, seed=3)
    ours, theirs = layer.dequantized_weight(), _file_weight(raw, kind)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # every bit, the sign of a zero too


@pytest.mark.parametrize("kind", list(TYPES))
def test_each_types_layer_reads_the_files_own_bytes_a_weight(kind):
    """The file's factors kept as it keeps them (Q8_0 and Q5_0: d float16; Q6_K: sc a byte, d float16 per 256), so a
    layer of whole blocks of rows is the file's bytes; Q5_K's 6-bit sc and m take a byte each (180 bytes a 256)."""
    layer, raw = _layer(kind, 768, 48, seed=3)
    assert layer.packed_weight.numel() * {"Q5_K": 176}.get(kind, 1) == raw.nbytes * {"Q5_K": 180}.get(kind, 1)


def test_the_kernels_constant_forms_are_the_gguf_types_forms():
    """levels_layout.h compiles the matmul for each .gguf type's form as a constant (LV_BY_FORM); a form there that is
    not the one the type gets would leave that type on the code that reads its form, slower."""
    header = (Path(binding.__file__).parent / "levels_layout.h").read_text(encoding="utf-8")
    for name, value in (("LV_FLOAT32", "0"), ("LV_FLOAT16", "1"), ("LV_FACTORS", "2")):
        header = header.replace(name, value)
    constant = {name: eval(expression, {"__builtins__": {}})  # digits, | and << only: C's and Python's precedence
                for name, expression in re.findall(r"#define LV_(\w+)_FORM \(([\d |<]+)\)", header)}
    given = {kind: _layer(kind, 256, 16)[0].form for kind in TYPES}
    given["K_MIX"] = _k_mix(256)[0].form
    assert constant == given


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize(("width", "rows"), SHAPES)
def test_the_kernel_computes_its_definition(code_path, kind, width, rows):
    layer, _ = _layer(kind, width, rows, bias=kind == "Q8_0", seed=width + rows)
    for tokens in TOKEN_COUNTS:
        reference = _reference(layer, _inputs(tokens, width, seed=tokens))
        error = (layer(_inputs(tokens, width, seed=tokens)).double() - reference).abs().amax()
        assert error <= 1e-5 * (1 + reference.abs().amax()), (tokens, float(error))


@pytest.mark.parametrize("kind", list(TYPES))
def test_a_tokens_output_does_not_depend_on_the_others(code_path, kind):
    layer, _ = _layer(kind, 1280, 37, seed=5)
    x = _inputs(20, 1280)  # tiles of 8 (AVX2: 4) and the many-token path's chunks of groups
    together = layer(x)
    for tokens in TOKEN_COUNTS:
        assert torch.equal(layer(x[:tokens]), together[:tokens]), tokens
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(20)]), together)


def _on_vnni_and_avx2(monkeypatch, layer: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The layer's output on the VNNI code, then on the AVX2 code (skipped on a CPU without AVX512-VNNI)."""
    library, isa, _ = binding.library()
    if isa < 2:
        pytest.skip("this CPU has no AVX512-VNNI")
    outputs = []
    for path in (2, 1):
        monkeypatch.setattr(binding, "library", lambda path=path: (library, path, None))
        outputs.append(layer(x))
    return outputs


@pytest.mark.parametrize("kind", list(TYPES))
def test_the_vnni_and_avx2_code_agree_bit_for_bit(monkeypatch, kind):
    layer, _ = _layer(kind, 1280, 37, bias=True, seed=7)
    assert torch.equal(*_on_vnni_and_avx2(monkeypatch, layer, _inputs(11, 1280)))


def test_layers_of_different_types_fused_keep_each_layers_weights_and_rows():
    """A Q4_K q and k beside a Q6_K v and a Q8_0 row set (as a Q4_K_M file's attention has them): one levels layer
    in the general form, each layer's weights as they were (values: a zero's sign may differ) and each row's output
    its own weights' product."""
    q_and_k = Q4KLinear.from_k_parts(*_q4k_parts(48, 512), None, 512)
    parts = [q_and_k, _layer("Q6_K", 512, 21, seed=1)[0], _layer("Q8_0", 512, 16, seed=2)[0]]
    joined = fused(parts)
    assert type(joined) is LevelsLinear and joined.out_features == 48 + 21 + 16
    assert torch.equal(joined.dequantized_weight(), torch.cat([part.dequantized_weight() for part in parts]))
    x = _inputs(3, 512)
    reference = _reference(joined, x)
    assert (joined(x).double() - reference).abs().amax() <= 1e-5 * (1 + reference.abs().amax())


def _k_mix(width: int) -> tuple[LevelsLinear, list[torch.nn.Module]]:
    """A Q4_K q and k beside a Q6_K v fused (a Q4_K_M file's attention), and the parts."""
    parts = [Q4KLinear.from_k_parts(*_q4k_parts(48, width), None, width), _layer("Q6_K", width, 21, seed=1)[0]]
    return fused(parts), parts


def test_a_q4k_and_q6k_fused_keep_their_factors_and_weights(code_path):
    """Fused, a Q4_K q and k and a Q6_K v keep their factors (sc and m a byte per 16 channels, d and dmin float16 per
    256: 7.125 bits a weight, where the general form takes 12), each layer's weights, and the kernel its definition,
    each token's output its own."""
    joined, parts = _k_mix(1280)
    assert joined.packed_weight.numel() * 8 == 7.125 * 1280 * 80  # 48 + 21 rows: 5 blocks of 16
    assert torch.equal(joined.dequantized_weight(), torch.cat([part.dequantized_weight() for part in parts]))
    x = _inputs(11, 1280)
    reference, together = _reference(joined, x), joined(x)
    assert (together.double() - reference).abs().amax() <= 1e-5 * (1 + reference.abs().amax())
    assert torch.equal(torch.cat([joined(x[i:i + 1]) for i in range(11)]), together)


def test_a_fused_k_mix_on_vnni_and_avx2_agrees_bit_for_bit(monkeypatch):
    joined, _ = _k_mix(1280)
    assert torch.equal(*_on_vnni_and_avx2(monkeypatch, joined, _inputs(11, 1280)))


def test_layers_of_one_type_fused_keep_their_bytes():
    parts = [_layer("Q5_0", 256, 32, seed=1)[0], _layer("Q5_0", 256, 16, seed=2)[0]]
    joined = fused(parts)
    assert joined.form == parts[0].form
    assert torch.equal(joined.packed_weight, torch.cat([part.packed_weight for part in parts]))
    first = _layer("Q6_K", 256, 21, seed=1)[0]  # rows not whole blocks: the parts joined, in the same form
    odd = fused([first, _layer("Q6_K", 256, 7, seed=2)[0]])
    assert odd.form == first.form
    assert torch.equal(odd(_inputs(2, 256))[:, :21], first(_inputs(2, 256)))


def test_selected_rows_score_what_the_whole_layer_scores():
    layer, _ = _layer("Q6_K", 512, 40, bias=True, seed=9)
    rows = torch.tensor([39, 0, 17, 17, 5])
    x = _inputs(3, 512)
    assert torch.equal(layer.select_rows(rows)(x), layer(x)[:, rows])


def _q4k_parts(rows: int, width: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(rows)

    def integers(shape, top):
        return torch.randint(0, top, shape, generator=generator, dtype=torch.uint8)

    d, dmin = ((torch.rand(rows, width // 256, generator=generator) * 2e-3).half() for _ in range(2))
    return integers((rows, width), 16), integers((rows, width // 32), 64), integers((rows, width // 32), 64), d, dmin
