"""On the real demo pair: the batched engine's greedy output equals batch size 1's, token for token — in
float32 (the cached weights upcast; equal up to rounding, which must not flip a token on these prompts) and
on the int8 target `auto` picks on a CPU (bit for bit by construction: row-wise attention over each row's
own keys, and a prompt's chat-template prefix computed once for all of them), with rows of different lengths
finishing and refilled (batch 3, four prompts)."""

import pytest

from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.batched import RowRequest
from specdec_cli.models import load_pair
from specdec_cli.session import DRAFT_WINDOW, build_batched_decoder, encode_chat, eos_token_ids

from tests.models.test_demo_real import requires_demo

pytestmark = [pytest.mark.real, requires_demo]

QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
    "What does `git rebase` do?",
    "Name three sorting algorithms.",
]
BUDGETS = [24, 12, 20, 16]


@pytest.fixture(scope="module", params=["float32", "int8"])
def pair(request):
    if request.param == "float32":
        target, draft = load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", dtype="bfloat16", progress=False)
        target.model.float()
        draft.model.float()
        return target, draft
    return load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", dtype="bfloat16",
                     target_quantization="int8", draft_quantization="int8", progress=False)


@pytest.mark.parametrize("drafter, k", [("none", 0), ("cascade", 3)])
def test_batched_greedy_equals_batch_one_on_the_real_pair(pair, drafter, k):
    target, draft = pair
    eos = eos_token_ids(target)
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    alone = [SpeculativeDecoder(target.model, None, FixedK(0), eos).generate(prompt, SamplingParams(), budget).tokens
             for prompt, budget in zip(prompts, BUDGETS)]
    decoder = build_batched_decoder(target, draft, drafter, k, 3)
    results = decoder.generate_many([RowRequest(prompt, SamplingParams(), budget) for prompt, budget in zip(prompts, BUDGETS)])
    assert [result.tokens for result in results] == alone
    # the int8 target computes rows alone: a prompt's chat-template prefix is computed once for all four
    assert decoder.target.reuse_prompts == (target.quantization == "int8")
    if drafter != "none":
        assert sum(result.stats.drafted for result in results) > 0
        # the draft scores its 65,536 most frequent ids (Qwen2.5's vocabulary is 151,936) and reads a window
        assert len(decoder.draft_ids) < draft.vocab_size // 2 and decoder.draft_window == DRAFT_WINDOW
