"""A q4 target reading its prompts with its own weights on AMX in bfloat16 (q4_amx.c's isa 4, models/prefill.py's
AmxPromptPath): the matmul computes its definition (weights and activations rounded to bfloat16, products summed in
float32) for both layouts, each row whatever else the call holds, at any count; the path reads prompts into the
engine's cache (entries near q4's own read, not equal to them), speculation on it is that target alone, turn after
turn, and a prompt after a kept one computes only what it does not share, the entries those of reading it alone. These need a CPU with AMX-BF16: they skip elsewhere (this project's CI machines have
none; the copy path, tests/models/test_prefill.py, is what runs there)."""

import copy

import pytest
import torch

from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.kv import CachedModel, prefill_path
from specdec_cli.models.formats import q4
from specdec_cli.models.loading import prefill, preflight
from specdec_cli.models.native import binding
from specdec_cli.models.runtime.quantize import computes_rows_alone, quantize

from tests.conftest import tiny_causal_lm
from tests.engine.test_prompt_reuse import read_alone, same_entries
from tests.models.test_prefill import NEW_TOKENS, speculation_is_that_target_alone_turn_after_turn
from tests.models.test_q4_kernel import _layer


def _amx_bf16() -> bool:
    library, isa, problem = binding.library()
    return problem is None and isa == 3 and bool(library.specdec_amx_bf16_ready())


pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(q4.kernel_problem() is not None, reason=f"q4 needs specdec's C kernels: {q4.kernel_problem()}"),
    pytest.mark.skipif(q4.kernel_problem() is None and not _amx_bf16(), reason="this CPU has no AMX-BF16"),
]
PROMPT = [1] + [(7 * i + 2) % 90 + 3 for i in range(59)]  # 60 tokens: two pieces of 30 or one of 60


def _matmul(layer: q4.Q4Linear, x: torch.Tensor, isa: int) -> torch.Tensor:
    library = binding.library()[0]
    out = torch.empty(x.shape[0], layer.out_features)
    groups = q4.packed_groups(layer.packed_weight, layer.layout)
    assert library.specdec_q4_linear(isa, layer.layout, 2, x.data_ptr(), x.shape[0], x.shape[1], groups,
                                     layer.packed_weight.data_ptr(),
                                     None if layer.bias is None else layer.bias.data_ptr(), layer.out_features,
                                     out.data_ptr()) == 0
    return out


@pytest.mark.parametrize(("layout", "in_features", "out_features"),
                         [("q4", 100, 37), ("q4", 1100, 48), ("q4k", 768, 200), ("q4k", 256, 37)])
@pytest.mark.parametrize("tokens", [24, 40, 100])
def test_the_prompt_matmul_sums_bfloat16_products_in_float32(layout, in_features, out_features, tokens):
    layer = _layer(layout, in_features, out_features, bias=True, seed=tokens + in_features)
    x = torch.randn(tokens, in_features) * torch.logspace(-2, 1, tokens)[:, None]
    weight = layer.dequantized_weight().bfloat16().double()
    expected = x.bfloat16().double() @ weight.T + layer.bias.double()
    got = _matmul(layer, x, 4).double()
    # float32 sums of exact products: within a few ulps of the rows' magnitudes; q4's own int8 code is ~1e-2 away
    scale = (x.bfloat16().double().abs() @ weight.abs().T).clamp_min(1e-30)
    assert ((got - expected).abs() / scale).max() < 1e-5
    assert ((_matmul(layer, x, 3).double() - expected).abs() / scale).max() > 1e-4


@pytest.mark.parametrize("layout", ["q4", "q4k"])
def test_a_rows_result_does_not_depend_on_the_others_at_any_count(layout):
    """Down to one row: the rest of a prompt read after a kept prefix is what reading the whole gives."""
    layer = _layer(layout, 512, 48, seed=3)
    x = torch.randn(100, 512)
    whole = _matmul(layer, x, 4)
    for start, stop in ((0, 24), (40, 80), (0, 23), (17, 22), (99, 100)):
        assert torch.equal(_matmul(layer, x[start:stop].contiguous(), 4), whole[start:stop]), (start, stop)
    assert not torch.equal(_matmul(layer, x[:5].contiguous(), 3), whole[:5])  # not the int8 code's


class _Loaded:  # what prefill.attach and wanted read of a LoadedModel
    name, device, quantization = "tiny", torch.device("cpu"), "q4"

    def __init__(self, model):
        self.model = model


@pytest.fixture(scope="module", params=[("qwen2", 2), ("llama", 0), ("qwen3", 0), ("phi3-partial", 0)],
                ids=["qwen2", "llama", "qwen3", "phi3-partial"])
def pair(request):
    """(a q4 target reading its prompts on AMX, its float model)"""
    float_model = tiny_causal_lm(request.param[0], seed=request.param[1], logit_scale=8.0, layers=4)
    target = quantize(copy.deepcopy(float_model), "q4")
    loaded = _Loaded(target)
    assert prefill.amx_reads(loaded)
    prefill.attach(loaded)
    assert isinstance(prefill_path(target), prefill.AmxPromptPath)
    return target, float_model


@pytest.fixture(scope="module")
def draft():
    return quantize(tiny_causal_lm("llama", seed=0, logit_scale=8.0, layers=2), "q4")


def _entries(runner: CachedModel, length: int) -> list[torch.Tensor]:
    return [layer.keys[..., :length, :].clone() for layer in runner.cache.layers]


@torch.inference_mode()
def test_the_path_reads_prompts_near_q4s_own_read_but_not_as_it(pair):
    target, _ = pair
    read, own, pieces = CachedModel(target), CachedModel(target), CachedModel(target, prefill_chunk=30)
    read.prefill(PROMPT)
    pieces.prefill(PROMPT)  # 30 + 30: the same rows as read in one forward
    own.extend(PROMPT)
    assert read.ids == PROMPT and read.cache.layers[0].keys.dtype == torch.float32
    for mine, split, q4_own in zip(_entries(read, 60), _entries(pieces, 60), _entries(own, 60)):
        assert torch.equal(mine, split)
        # the same weights: only the roundings differ (bfloat16 here, int8 per 32 activations in q4's own read)
        assert not torch.equal(mine, q4_own) and (mine - q4_own).abs().max() < 0.02 * q4_own.abs().max()
    assert computes_rows_alone(target)  # so run and chat's /reset keep a shared prefix (below)


def test_speculation_on_it_is_that_target_alone_turn_after_turn(pair, draft):
    speculation_is_that_target_alone_turn_after_turn(pair[0], draft, PROMPT)


def test_it_holds_no_copy_needs_no_memory_and_says_who_reads(pair, monkeypatch):
    from specdec_cli.bench.probes import prompt_reader
    from specdec_cli.models.loading.loaded import LoadedModel

    target, _ = pair
    path = target.__dict__.pop("_specdec_prefill")
    try:
        alone = preflight.held_weight_bytes(target)
    finally:
        target.__dict__["_specdec_prefill"] = path
    assert preflight.held_weight_bytes(target) == alone
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: 1000)
    assert prefill.wanted("auto", _Loaded(target))
    assert not prefill.amx_reads(_Loaded(target), flags={"avx512_bf16", "avx2"})  # a CPU without AMX: the copy
    fake = type("Loaded", (), {"model": target})()
    assert prompt_reader(fake) == "target in bfloat16 on AMX"
    assert "prompts read in bfloat16 (--prefill)" in LoadedModel.describe(
        type("L", (), {"name": "tiny", "device": "cpu", "dtype": torch.float32, "quantization": None,
                       "model": target})(), "target")


def test_a_q4_draft_reads_its_window_on_amx_and_the_output_stays_the_targets(pair):
    """A q4 draft given the AMX path (settings._read_prompts does where the CPU has it) reads a long unread part of its
    window through it, through a subset head too (drafters.subset_head.with_prompt_path); the drafts change a little,
    the tokens do not (the target verifies them)."""
    from specdec_cli.drafters import DraftModelDrafter
    from specdec_cli.drafters.tree import TreeDrafter

    target, _ = pair
    draft_model = quantize(tiny_causal_lm("llama", seed=0, logit_scale=8.0, layers=2), "q4")
    plain = DraftModelDrafter(draft_model, token_ids=torch.arange(80), window=40)
    prefill.attach(_Loaded(draft_model))
    assert isinstance(prefill_path(draft_model), prefill.AmxPromptPath)
    expected = SpeculativeDecoder(target, None, FixedK(0), ()).generate(PROMPT, SamplingParams(), NEW_TOKENS).tokens
    for drafter in (DraftModelDrafter(draft_model, token_ids=torch.arange(80), window=40),
                    TreeDrafter(draft_model, budget=8, branching=2, window=40)):
        assert prefill_path(drafter.runner.model) is prefill_path(draft_model)
        result = SpeculativeDecoder(target, drafter, FixedK(4), ()).generate(PROMPT, SamplingParams(), NEW_TOKENS)
        assert result.tokens == expected and result.stats.drafted > 0
    # the path was taken: the window's entries are not what the draft's own q4 read makes
    read = DraftModelDrafter(draft_model, token_ids=torch.arange(80), window=40)
    read.propose(PROMPT, 1, SamplingParams(), torch.Generator())
    plain.propose(PROMPT, 1, SamplingParams(), torch.Generator())
    assert read.runner.ids == plain.runner.ids and len(read.runner.ids) >= 40
    assert not torch.equal(read.runner.cache.layers[0].keys, plain.runner.cache.layers[0].keys)


@torch.inference_mode()
def test_a_prompt_after_a_kept_one_reads_only_the_rest_and_its_entries_are_reading_it_alone(pair, monkeypatch):
    """kv.py's `prefill(fresh=True)` on the AMX path (tests/engine/test_prompt_reuse.py has the cases on a stand-in
    path): the rest after a shared prefix, even 3 tokens, is read by the path (not q4's own int8 code), a short prompt
    after a long one by q4 itself from the start; entries equal bit for bit, tokens too, through the decoder's reset."""
    target, _ = pair
    read = []
    original = prefill.AmxPromptPath.__call__

    def counting(self, cache, new_ids):
        read.append(len(new_ids))
        return original(self, cache, new_ids)

    monkeypatch.setattr(prefill.AmxPromptPath, "__call__", counting)
    prompts = [(PROMPT, 59), (PROMPT[:40] + [5, 6, 7, 8], 3), (PROMPT[:10] + [9], 0), (PROMPT[:40] + [7] * 30, 69)]
    runner = CachedModel(target)
    decoder = SpeculativeDecoder(target, None, FixedK(0), (), reuse_prompts=computes_rows_alone(target))
    for prompt, by_path in prompts:
        read.clear()
        runner.prefill(prompt[:-1], fresh=True)
        runner.extend(prompt)
        assert sum(read) == by_path, prompt
        assert same_entries(runner, read_alone(target, prompt)), prompt
        decoder.reset()
        tokens = decoder.generate(prompt, SamplingParams(), NEW_TOKENS).tokens
        assert tokens == SpeculativeDecoder(target, None, FixedK(0), ()).generate(
            prompt, SamplingParams(), NEW_TOKENS).tokens
