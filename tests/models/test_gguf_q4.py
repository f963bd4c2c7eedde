"""q4 takes a .gguf's 4-bit layers as they are (formats/gguf_q4.py, read in place by loading/gguf_model.py): the file's
own values, not a requantisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_cli.engine.kv import CachedModel
from specdec_cli.models import load_model
from specdec_cli.models.formats import gguf_q4
from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear, dequantize, quantize_packed
from tests.tiny import build_4bit_gguf, random_blocks

pytest.importorskip("gguf")

TYPES = {"Q4_0": gguf_q4.Q4_0, "Q4_1": gguf_q4.Q4_1, "Q4_K": gguf_q4.Q4_K}


def _file_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    """The .gguf's own values of a tensor, dequantised by the gguf package (float32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))


def _within_float16_rounding(ours: torch.Tensor, scales, minimums, reference: torch.Tensor) -> bool:
    """Each weight within what rounding its step and minimum to float16 can move it: 2⁻¹¹ · (15·|step| + |minimum|)."""
    width = ours.shape[1]
    step = scales.float().repeat_interleave(32, dim=1)[:, :width]
    minimum = minimums.float().repeat_interleave(32, dim=1)[:, :width]
    bound = (15 * step.abs() + minimum.abs()) * 2.0 ** -11 + 1e-9
    return bool(((ours - reference).abs() <= bound).all())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_blocks_become_q4_with_the_files_weights_bit_for_bit(kind):
    raw = random_blocks(kind, 48, 768, np.random.default_rng(3))
    levels, scales, minimums = gguf_q4.block_parts(raw, TYPES[kind])
    assert levels.shape == (48, 768) and scales.shape == minimums.shape == (48, 24) and int(levels.max()) <= 15
    assert torch.equal(dequantize(levels, scales, minimums), _file_weight(raw, kind))


def test_q4_k_blocks_become_a_q4k_layer_with_the_files_weights_bit_for_bit():
    raw = random_blocks("Q4_K", 48, 768, np.random.default_rng(3))
    parts = gguf_q4.block_parts(raw, gguf_q4.Q4_K)
    levels, sub_scales, sub_minimums, d, dmin = parts
    assert levels.shape == (48, 768) and sub_scales.shape == sub_minimums.shape == (48, 24)
    assert d.shape == dmin.shape == (48, 3) and int(levels.max()) <= 15 and int(sub_scales.max()) <= 63
    layer = Q4KLinear.from_k_parts(*parts, None, 768)
    reference = _file_weight(raw, "Q4_K")
    assert torch.equal(layer.dequantized_weight(), reference)
    # Layout 0 of the same (how q4 held a Q4_K layer until 2026-12-05, and still holds one fused with other
    # layout-0 rows): each step and minimum rounded to float16, within that rounding but not exact.
    held = layer.q4_parts()
    as_layout_0 = dequantize(*held)
    assert _within_float16_rounding(as_layout_0, held[1], held[2], reference)
    assert not torch.equal(as_layout_0, reference)
    # Requantising the same weights (what q4 did with a .gguf before that) moves them by up to half a step: far more.
    requantised = Q4Linear(quantize_packed(reference), None, 768, 48).dequantized_weight()
    assert not _within_float16_rounding(requantised, held[1], held[2], reference)


@pytest.fixture(scope="module")
def qwen2_q4k_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-q4k") / "tiny-qwen2-q4k.gguf"
    return path, build_4bit_gguf(path, arch="qwen2", kind="Q4_K")


def test_a_q4_k_gguf_runs_on_its_own_4_bit_values(qwen2_q4k_gguf):
    path, blocks = qwen2_q4k_gguf
    loaded = load_model(str(path), quantization="q4", progress=False)
    model = loaded.model
    assert model._specdec_q4_from_gguf == (15, 15)  # 2 layers × 7 projections and the output layer
    assert loaded.describe("target").endswith("· 15 of 15 layers kept as the .gguf's own blocks (15 Q4_K)")
    layer = model.model.layers[1]
    for name, module, rows in (("blk.1.attn_output.weight", layer.self_attn.o_proj, slice(None)),
                               ("blk.1.ffn_down.weight", layer.mlp.down_proj, slice(None)),
                               ("blk.1.ffn_up.weight", layer.mlp.gate_up_proj, slice(512, None)),  # fused after gate
                               ("blk.1.attn_k.weight", layer.self_attn.qkv_proj, slice(256, 384)),
                               ("output.weight", model.lm_head, slice(None))):
        assert type(module) is Q4KLinear, name
        assert torch.equal(module.dequantized_weight()[rows], _file_weight(blocks[name], "Q4_K")), name
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert torch.isfinite(logits).all()


VERIFIED_IDS = [(11 * i + 5) % 90 + 3 for i in range(40)]


def verify_is_decoding(path, float_dtype: str | None = None) -> None:
    """A .gguf read in place in q4, its whole decoder in one C call and its lean layers one C call each: each verifies
    10 tokens as it decodes them one by one, bit for bit, both give the same logits, and those are the file's float
    model's (`float_dtype`: how it loads; None, its default) up to the int8 activations' rounding (~1e-2; a layout
    read wrongly gives ~1)."""
    stacked, layered = (load_model(str(path), quantization="q4", progress=False).model for _ in range(2))
    del layered.model.forward  # transformers' forward: the lean layers one C call at a time, not the stack's one
    ids = VERIFIED_IDS
    results = []
    for model in (stacked, layered):
        verify, decode = CachedModel(model), CachedModel(model)
        verify.extend(ids[:30], 1)
        decode.extend(ids[:30], 1)
        verified = verify.extend(ids, 10)
        decoded = torch.cat([decode.extend(ids[:n], 1) for n in range(31, 41)])
        assert torch.equal(verified, decoded)
        results.append(verified)
    assert torch.equal(*results)
    options = {} if float_dtype is None else {"dtype": float_dtype}
    float_model = load_model(str(path), progress=False, **options).model
    expected = float_model(input_ids=torch.tensor([ids])).logits[0, 30:].float()
    assert torch.linalg.norm(results[0] - expected) <= 5e-2 * torch.linalg.norm(expected)


def test_a_q4_k_model_verifies_what_it_decodes_token_by_token_bit_for_bit_in_one_call_or_layer_by_layer(
        qwen2_q4k_gguf):
    path, _ = qwen2_q4k_gguf
    verify_is_decoding(path)  # against the float model with its weights through bfloat16 (its default)


def test_a_q4_0_gguf_runs_on_the_files_weights_bit_for_bit(tmp_path):
    path = tmp_path / "tiny-qwen2-q4_0.gguf"
    blocks = build_4bit_gguf(path, arch="qwen2", kind="Q4_0")
    model = load_model(str(path), quantization="q4", progress=False).model
    assert model._specdec_q4_from_gguf == (15, 15)
    down = model.model.layers[0].mlp.down_proj.dequantized_weight()
    assert torch.equal(down, _file_weight(blocks["blk.0.ffn_down.weight"], "Q4_0"))


def test_a_llama_files_q_and_k_rows_go_where_transformers_puts_them(tmp_path):
    path = tmp_path / "tiny-llama-q4k.gguf"
    blocks = build_4bit_gguf(path, arch="llama", kind="Q4_K")
    model = load_model(str(path), quantization="q4", progress=False).model
    float_model = load_model(str(path), progress=False).model
    assert model._specdec_q4_from_gguf == (15, 15)
    fused = model.model.layers[0].self_attn.qkv_proj.dequantized_weight()
    for name, rows, heads, module in (("blk.0.attn_q.weight", slice(0, 256), 4, "q_proj"),
                                      ("blk.0.attn_k.weight", slice(256, 384), 2, "k_proj")):
        # llama.cpp stores each head's rows interleaved (halves of the rotary pairs): undone as transformers does
        per_head = 256 // 4 // 2 if heads == 4 else 128 // 2 // 2
        order = np.arange(fused[rows].shape[0]).reshape(heads, per_head, 2).swapaxes(1, 2).reshape(-1)
        file_rows = _file_weight(blocks[name], "Q4_K")[torch.from_numpy(order)]
        assert torch.equal(fused[rows], file_rows), name
        loaded = getattr(float_model.model.layers[0].self_attn, module).weight.float()
        assert torch.linalg.norm(fused[rows] - loaded) <= 1e-2 * torch.linalg.norm(loaded)


def test_a_gguf_table_reads_as_the_gguf_package_reads_it(qwen2_q4k_gguf):
    from gguf import GGUFReader

    path, blocks = qwen2_q4k_gguf
    table = gguf_q4._Table(path)
    assert table.architecture == "qwen2"
    for tensor in GGUFReader(str(path)).tensors:
        kind, shape, _ = table.tensors[tensor.name]
        assert kind == int(tensor.tensor_type) and shape == tuple(reversed([int(n) for n in tensor.shape]))
    assert gguf_q4.element_count(path) == sum(int(np.prod(tensor.shape)) for tensor in GGUFReader(str(path)).tensors)
