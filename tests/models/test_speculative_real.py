"""End to end on the real demo pair: speculative greedy decoding is token-identical to the target
alone, and our target-alone decoding is token-identical to HF generate.

Computed in fp32 (the cached bf16 weights upcast): identity is a property of the algorithm, and fp32
keeps batched-verify vs one-token numerics from flipping near-tied argmaxes."""

import pytest
import torch

from specdec_cli.models import load_pair
from specdec_cli.session import build_decoder, encode_chat, eos_token_ids
from specdec_cli.engine import SamplingParams

from tests.models.test_demo_real import requires_demo

pytestmark = [pytest.mark.real, requires_demo]

QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def fp32_pair():
    target, draft = load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", dtype="bfloat16", progress=False)
    target.model.float()
    draft.model.float()
    return target, draft


@pytest.fixture(scope="module")
def prompts(fp32_pair):
    target, _ = fp32_pair
    return [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def baselines(fp32_pair, prompts):
    target, draft = fp32_pair
    decoder = build_decoder(target, draft, "none", 0)
    results = []
    for prompt in prompts:
        decoder.reset()
        results.append(decoder.generate(prompt, SamplingParams(), NEW_TOKENS).tokens)
    return results


def test_target_alone_equals_hf_generate(fp32_pair, prompts, baselines):
    target, _ = fp32_pair
    eos = list(eos_token_ids(target))
    for prompt, ours in zip(prompts, baselines):
        output = target.model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=eos[0]
        )
        assert output[0, len(prompt):].tolist() == ours


@pytest.mark.parametrize("drafter, k", [("model", 4), ("model", "auto"), ("ngram", 4), ("tree", 4), ("tree", "auto")])
def test_speculative_equals_target_alone(fp32_pair, prompts, baselines, drafter, k):
    target, draft = fp32_pair
    decoder = build_decoder(target, draft, drafter, k)
    drafted = tree_steps = 0
    for prompt, baseline in zip(prompts, baselines):
        decoder.reset()
        result = decoder.generate(prompt, SamplingParams(), NEW_TOKENS)
        assert result.tokens == baseline
        drafted, tree_steps = drafted + result.stats.drafted, tree_steps + result.stats.tree_steps
    assert drafted > 0 and (tree_steps > 0) == (drafter == "tree")  # a tree drafter verified trees
