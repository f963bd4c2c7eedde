"""A .gguf whose layers are Q8_0, Q6_K, Q5_0 and Q5_K (a Q4_K_M file's Q6_K, the demo draft's Q5_0 and Q8_0) runs in q4
with each of those layers on the file's own weights (formats/gguf_levels.py, formats/levels.py): the load line says
no requantisation for them (a type still without a kernel still says it), a verify is one-token decoding bit for bit,
and speculative greedy decoding is the target alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.models import load_model
from specdec_cli.models.formats.levels import LevelsLinear
from specdec_cli.models.native import binding
from tests.conftest import hf_greedy
from tests.models.test_gguf_q4 import verify_is_decoding
from tests.tiny import build_4bit_gguf

pytest.importorskip("gguf")
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(binding.library()[0] is None, reason=f"no kernels: {binding.library()[2]}")]

# A Q4_K_M-like mix with every type that has a levels kernel, each in more than one place
MIX = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "Q8_0", "ffn_up": "Q5_0", "ffn_gate": "Q5_K"}


def _file_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-levels") / "tiny-qwen2-mix.gguf"
    return path, build_4bit_gguf(path, arch="qwen2", kind="Q4_K", kinds=MIX)


def test_each_layer_of_a_kernel_type_runs_on_the_files_weights_and_the_load_line_says_no_requantisation(mixed_gguf):
    path, blocks = mixed_gguf
    loaded = load_model(str(path), quantization="q4", progress=False)
    model = loaded.model
    assert model._specdec_q4_from_gguf == (15, 15) and model._specdec_requantised == {}
    assert loaded.describe("target").endswith(
        "· 15 of 15 layers kept as the .gguf's own blocks (5 Q4_K, 4 Q6_K, 2 Q5_0, 2 Q5_K, 2 Q8_0)")
    assert "requantised" not in loaded.describe("target")
    layer = model.model.layers[1]
    for name, module, rows in (("blk.1.attn_output.weight", layer.self_attn.o_proj, slice(None)),
                               ("blk.1.ffn_down.weight", layer.mlp.down_proj, slice(None)),
                               ("blk.1.ffn_gate.weight", layer.mlp.gate_up_proj, slice(0, 512)),
                               ("blk.1.ffn_up.weight", layer.mlp.gate_up_proj, slice(512, None)),
                               ("blk.1.attn_v.weight", layer.self_attn.qkv_proj, slice(384, None)),  # after q, k
                               ("blk.1.attn_q.weight", layer.self_attn.qkv_proj, slice(0, 256))):  # Q4_K beside
        kind = next((other for piece, other in MIX.items() if piece in name), "Q4_K")
        assert type(module) is LevelsLinear, name
        assert torch.equal(module.dequantized_weight()[rows], _file_weight(blocks[name], kind)), name


def test_a_type_without_a_kernel_is_still_requantised_and_said(tmp_path):
    path = tmp_path / "q2k.gguf"
    build_4bit_gguf(path, kinds={"ffn_down": "Q2_K", "attn_v": "Q6_K"})
    loaded = load_model(str(path), quantization="q4", progress=False)
    assert loaded.model._specdec_requantised == {"Q2_K": 2}
    assert loaded.describe("target").endswith("· 13 of 15 layers kept as the .gguf's own blocks (11 Q4_K, 2 Q6_K) · "
                                              "2 Q2_K requantised to q4 (no kernel for that type yet)")


def test_a_verify_is_one_token_decoding_bit_for_bit_in_one_call_or_layer_by_layer(mixed_gguf):
    path, _ = mixed_gguf
    verify_is_decoding(path, float_dtype="float32")


def test_speculative_greedy_is_the_target_alone(mixed_gguf, tmp_path):
    """With another file as the draft (most drafts rejected) and with the target's own file (every one accepted:
    verifies of 4 tokens whose rows must be what decoding gives, or greedy would part from the target's)."""
    path, _ = mixed_gguf
    target = load_model(str(path), quantization="q4", progress=False).model
    other = tmp_path / "draft.gguf"
    build_4bit_gguf(other, arch="qwen2", kind="Q8_0", seed=1, kinds={"ffn_down": "Q5_0", "attn_v": "Q6_K"})
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(20)]
    expected = hf_greedy(target, prompt, 24)
    for draft_path in (other, path):
        draft = load_model(str(draft_path), quantization="q4", progress=False).model
        result = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(3)).generate(prompt, SamplingParams(), 24)
        assert result.tokens == expected, draft_path.name
    assert result.stats.accepted >= 18  # the target's own file: its drafts accepted


def test_levels_layers_are_stored_and_read_back_the_same(mixed_gguf, specdec_home, monkeypatch):
    from specdec_cli.models.formats import stored_layers

    made, replacing = [], stored_layers.replace_linears_stored
    monkeypatch.setattr(stored_layers, "replace_linears_stored",
                        lambda model, store, make: replacing(model, store, lambda whole: made.append(1) or make(whole)))
    first, second = (load_model(str(mixed_gguf[0]), quantization="q4", progress=False).model for _ in range(2))
    assert made == [1]  # the second load read the stored layers
    ours, theirs = ({name: module for name, module in model.named_modules() if isinstance(module, LevelsLinear)}
                    for model in (first, second))
    assert ours.keys() == theirs.keys() and len(ours) == 8  # per layer: o, down, q/k/v fused, gate/up fused
    for name, layer in ours.items():
        assert layer.form == theirs[name].form and torch.equal(layer.packed_weight, theirs[name].packed_weight), name
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(first(input_ids=ids).logits, second(input_ids=ids).logits)
