"""A token tree verified on an int8 (or int4) target gives, for every node, the logits of one-token
decoding along that node's path, bit for bit: the tree mask reaches the row-wise attention as a boolean mask, which it
computes row by row over the keys each node may see (its prefix and ancestors). So speculative tree
greedy on a quantised target is that target's own output. The power check: the same tree under an additive
mask (which the row-wise attention hands to plain SDPA) is not bit-identical."""

import copy
import importlib.util

import pytest
import torch
from transformers import DynamicCache

from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, kv as kv_module
from specdec_cli.engine.kv import CachedModel, tree_capable
from specdec_cli.engine.tree import path_to
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import hf_greedy, tiny_causal_lm

IDS = [1] + [(7 * i + 2) % 90 + 3 for i in range(40)]
#        sequence
#        /      \
#      0:5      1:9
#     /   \       \
#   2:11  3:12    4:13
#          |
#         5:14
TREE, PARENTS = [5, 9, 11, 12, 13, 14], [-1, -1, 0, 0, 1, 3]


@pytest.fixture(scope="module", params=[("llama", 0, "int8"), ("qwen2", 2, "int8"), ("llama", 0, "int4")],
                ids=["llama-int8", "qwen2-int8", "llama-int4"])
def quantised_model(request):
    """Int8 models, and an int4 one (its attention runs row by row too)."""
    arch, seed, quantization = request.param
    if quantization == "int4" and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs the quant extra (torchao)")
    return quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4), quantization)


@torch.no_grad()
def one_token_decoding(model, prefix: list[int], path: list[int]) -> torch.Tensor:
    """The logits after `path`, fed one token per forward after a cached `prefix`: (V,)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix]), cache=cache)
    for token in path:
        logits = model(input_ids=torch.tensor([[token]]), cache=cache).logits[0, -1]
    return logits


def tree_rows(model) -> torch.Tensor:
    """One tree forward after the cached prefix IDS[:-1]: (1 + nodes, V), as the decoder verifies."""
    runner = CachedModel(model)
    runner.extend(IDS[:-1])
    return runner.extend_tree(IDS, TREE, PARENTS, sequence_logits=True)


def rows_equal_to_decoding(model, rows: torch.Tensor) -> list[bool]:
    """Per row (the sequence, then each node): bit-identical to one-token decoding along its path."""
    paths = [[IDS[-1]] + [TREE[n] for n in path_to(node, PARENTS)] for node in range(-1, len(TREE))]
    return [torch.equal(row, one_token_decoding(model, IDS[:-1], path)) for row, path in zip(rows, paths)]


def test_the_row_wise_attention_takes_a_tree_mask(quantised_model):
    assert quantised_model.config._attn_implementation == "specdec_rowwise" and tree_capable(quantised_model)


def test_tree_rows_are_one_token_decoding_along_each_path_bit_for_bit(quantised_model):
    assert rows_equal_to_decoding(quantised_model, tree_rows(quantised_model)) == [True] * (len(TREE) + 1)


@pytest.mark.parametrize("arch, seed", [("llama", 0), ("qwen2", 2)])
def test_an_additive_tree_mask_would_not_be_bit_identical_on_int8(arch, seed, monkeypatch):
    """(On the tiny int4 model plain SDPA happens to match bit for bit: no power there.)"""
    model = quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4), "int8")
    monkeypatch.setattr(kv_module, "_tree_mask_form", lambda model: "additive")
    assert not all(rows_equal_to_decoding(model, tree_rows(model)))


@pytest.mark.parametrize("quantization, budget, branching", [("int8", 6, 2), ("int8", 12, 3), ("int4", 8, 2), ("q4", 8, 2)])
def test_speculative_tree_greedy_on_a_quantised_target_is_that_target_alone(llama_target, llama_near_draft,
                                                                            quantization, budget, branching):
    if quantization == "int4" and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs the quant extra (torchao)")
    target = quantize(copy.deepcopy(llama_target), quantization)
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(30)]
    drafter = TreeDrafter(quantize(copy.deepcopy(llama_near_draft), "int8"), budget, branching)
    result = SpeculativeDecoder(target, drafter, FixedK(5)).generate(prompt, SamplingParams(), 40)
    assert result.tokens == hf_greedy(target, prompt, 40)
    assert result.stats.tree_steps > 0 and result.stats.tree_accepted > 0  # trees were verified and kept
