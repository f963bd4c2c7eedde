"""A quantised target verifies k tokens as k one-token forwards would: int8 scales activations per
token and int4 quantises weights only, so speculative decoding on a quantised target reproduces that
quantised target's own output. The per-tensor int8 of torch's `quantize_dynamic` does not (the power
check: the same tolerance catches it).

No sampling-distribution run here: the engine's (tests/engine/test_decode_sampling.py) holds for any
target whose verify rows equal its one-token forwards, which is what the row checks assert; a 20,000-draw
run through an int8 layer took ~13 minutes on the shared 2-core machine."""

import copy
import importlib.util
import warnings

import pytest
import torch
from transformers import DynamicCache

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.models.int4 import quantize_int4
from specdec_cli.models.quant import quantize

from tests.conftest import hf_greedy, tiny_causal_lm

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs the quant extra (torchao)")
IDS = torch.tensor([[1] + [(7 * i + 2) % 90 + 3 for i in range(20)]])
ROW_TOLERANCE = 1e-4  # float32 rounding: a multi-token forward sums in another order than a one-token one


def per_tensor_int8(model: torch.nn.Module) -> torch.nn.Module:
    """What specdec's int8 used to be: torch's deprecated dynamic quantisation, one activation scale per forward."""
    from torch.ao import quantization as ao

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ao.quantize_dynamic(model.float(), {torch.nn.Linear: ao.per_channel_dynamic_qconfig}, dtype=torch.qint8)


@torch.no_grad()
def worst_row_gap(model: torch.nn.Module, ids: torch.Tensor, first: int) -> float:
    """The largest |logit difference| between row i of one forward over `ids` and the forward of token i
    alone on a cache of ids[:i], over i >= first."""
    together = model(input_ids=ids).logits[0]  # (T, V)
    gaps = []
    for i in range(first, ids.shape[1]):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :i], cache=cache)
        alone = model(input_ids=ids[:, i : i + 1], cache=cache).logits[0, 0]  # (V,)
        gaps.append(float((together[i] - alone).abs().max()))
    return max(gaps)


@pytest.mark.parametrize("arch, seed", [("llama", 0), ("qwen2", 2)])
def test_int8_row_i_of_a_forward_is_the_one_token_forward(arch, seed):
    model = quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0), "int8")
    assert worst_row_gap(model, IDS, first=12) < ROW_TOLERANCE


@needs_torchao
@pytest.mark.parametrize("arch, seed", [("llama", 0), ("qwen2", 2)])
def test_int4_row_i_of_a_forward_is_the_one_token_forward(arch, seed):
    # float32 activations isolate the format; shipped int4 runs bfloat16, whose rounding any bf16 model has
    model = quantize_int4(tiny_causal_lm(arch, seed=seed, logit_scale=8.0), dtype=torch.float32)
    assert worst_row_gap(model, IDS, first=12) < ROW_TOLERANCE


@pytest.mark.parametrize("arch, seed", [("llama", 0), ("qwen2", 2)])
def test_per_tensor_int8_fails_the_row_check(arch, seed):
    model = per_tensor_int8(tiny_causal_lm(arch, seed=seed, logit_scale=8.0))
    assert worst_row_gap(model, IDS, first=12) > 100 * ROW_TOLERANCE


@pytest.fixture(scope="module")
def int8_draft(llama_near_draft):
    return quantize(copy.deepcopy(llama_near_draft), "int8")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_greedy_on_a_quantised_target_is_that_target_alone(llama_target, int8_draft, quantization, k):
    if quantization == "int4" and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs the quant extra (torchao)")
    target = quantize(copy.deepcopy(llama_target), quantization)
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(30)]
    result = SpeculativeDecoder(target, DraftModelDrafter(int8_draft), FixedK(k)).generate(prompt, SamplingParams(), 40)
    assert result.tokens == hf_greedy(target, prompt, 40)
    assert result.stats.accepted > 0  # verification of several tokens at once happened
