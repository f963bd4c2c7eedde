"""On the real demo pair: speculative greedy decoding on an int8 (int4, q4) target is token-identical to that
quantised target decoding alone. The draft is int8 too, as in the demo profile.

Without row-wise attention this failed at near-ties (top-2 margins of 0.006 and 0.125 logits): int8
activations turn SDPA's different summation order for k rows into ~1 logit of difference."""

import importlib.util

import pytest
import torch

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


LONG_QUESTION = ("Here is a function and its tests. Read them, say what the function does, and name the one case the "
                 "tests miss.\n\n```python\ndef merge(intervals):\n    intervals = sorted(intervals)\n    merged = []\n"
                 "    for start, end in intervals:\n        if merged and start <= merged[-1][1]:\n"
                 "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n"
                 "            merged.append([start, end])\n"
                 "    return merged\n\nassert merge([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]\n"
                 "assert merge([]) == []\n```")


def test_a_q4_target_reading_prompts_in_bfloat16_is_that_target_alone_for_every_drafter():
    """`--prefill bf16` on the demo pair (q4 target and draft): the prompt is read in bfloat16 (by the target's own
    weights on a CPU with AMX-BF16, else by its bfloat16 copy), and the chain, the tree and the target alone still
    give the same tokens; that read changes them from q4's own somewhere in the cache (checked on the prompt's
    entries)."""
    from specdec_cli.drafters.tree import TreeDrafter
    from specdec_cli.engine.kv import CachedModel, prefill_path
    from specdec_cli.models.loading import prefill

    target, draft = load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", target_quantization="q4",
                              draft_quantization="q4", progress=False)
    prefill.attach(target, progress=False)
    prompt = _prompt(target.tokenizer, LONG_QUESTION)
    assert len(prompt) > prefill_path(target.model).min_tokens
    eos = target.eos_token_ids
    baseline = SpeculativeDecoder(target.model, None, FixedK(0), eos).generate(prompt, SamplingParams(), NEW_TOKENS)
    for name, drafter, policy in (("chain", DraftModelDrafter(draft.model), FixedK(6)),
                                  ("tree", TreeDrafter(draft.model, budget=12), FixedK(4))):
        result = SpeculativeDecoder(target.model, drafter, policy, eos).generate(prompt, SamplingParams(), NEW_TOKENS)
        assert result.tokens == baseline.tokens, name
        assert result.stats.drafted > 0
    read, own = CachedModel(target.model), CachedModel(target.model)
    read.prefill(prompt)
    own.extend(prompt)
    assert read.ids == own.ids == prompt
    assert not torch.equal(read.cache.layers[-1].keys, own.cache.layers[-1].keys)
