"""On the real demo pair: speculative greedy decoding on an int8 (int4, q4) target is token-identical to that
quantised target decoding alone. The draft is int8 too, as in the demo profile.

Without row-wise attention this failed at near-ties (top-2 margins of 0.006 and 0.125 logits): int8
activations turn SDPA's different summation order for k rows into ~1 logit of difference."""

import importlib.util

import pytest

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.models import load_pair

from tests.models.test_demo_real import requires_demo

pytestmark = [pytest.mark.real, requires_demo]

QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["int8", "int4", "q4"])
def quantised_pair(request):
    if request.param == "int4" and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs the quant extra (torchao)")
    return load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", dtype="bfloat16",
                     target_quantization=request.param, draft_quantization="int8", progress=False)


def _prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text)["input_ids"]


def test_speculative_on_a_quantised_target_equals_that_target_alone(quantised_pair):
    target, draft = quantised_pair
    eos = target.eos_token_ids
    alone = SpeculativeDecoder(target.model, None, FixedK(0), eos)
    drafted = 0
    for question in QUESTIONS:
        prompt = _prompt(target.tokenizer, question)
        baseline = alone.generate(prompt, SamplingParams(), NEW_TOKENS).tokens
        alone.reset()
        for k in (4, 8):
            decoder = SpeculativeDecoder(target.model, DraftModelDrafter(draft.model), FixedK(k), eos)
            result = decoder.generate(prompt, SamplingParams(), NEW_TOKENS)
            assert result.tokens == baseline, (target.precision, k, question)
            drafted += result.stats.drafted
    assert drafted > 0
