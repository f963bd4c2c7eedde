"""On the real demo pair in the formats `auto` picks on an AVX512 CPU (q4 target, q4 draft): the batched engine's
greedy output equals the q4 target alone's, token for token, for k = auto and a fixed k, with the cascade (the
default drafter) — requests of different shapes (chat turns, raw code prompts; 3 to ~60 prompt tokens) and budgets
finishing at different steps and refilled (batch 3, five requests), and drafting on the way."""

import pytest

from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.batched import RowRequest
from specdec_cli.models import load_pair
from specdec_cli.session import build_batched_decoder, encode_chat, eos_token_ids

from tests.engine.test_batched import CHEAP_DRAFT, FLAT_VERIFY
from tests.models.test_demo_real import requires_demo

pytestmark = [pytest.mark.real, requires_demo, pytest.mark.timeout(1800)]

CHAT = [
    "Write a Python function that counts the vowels in a string.",
    "In two sentences: what is photosynthesis?",
    "List three prime numbers greater than 50.",
]
RAW = ["def quicksort(items):\n", "SELECT name, COUNT(*) FROM orders"]
BUDGETS = [40, 12, 28, 33, 20]


@pytest.fixture(scope="module")
def q4_pair():
    return load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", target_quantization="q4",
                     draft_quantization="q4", progress=False)


@pytest.fixture(scope="module")
def requests(q4_pair):
    target, _ = q4_pair
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for q in CHAT]
    prompts += [target.tokenizer(text)["input_ids"] for text in RAW]
    return [RowRequest(prompt, SamplingParams(), budget) for prompt, budget in zip(prompts, BUDGETS)]


@pytest.fixture(scope="module")
def alone(q4_pair, requests):
    target, _ = q4_pair
    decoder = SpeculativeDecoder(target.model, None, FixedK(0), eos_token_ids(target))
    results = []
    for request in requests:
        decoder.reset()
        results.append(decoder.generate(request.prompt_ids, SamplingParams(), request.max_new_tokens).tokens)
    return results


@pytest.mark.parametrize("k", ["auto", 4])
def test_a_q4_batch_is_the_q4_target_alone_on_the_real_pair(q4_pair, requests, alone, k):
    target, draft = q4_pair
    assert (target.quantization, draft.quantization) == ("q4", "q4")
    # k = auto priced on curves where drafting pays (a flat verify, a cheap draft), so the batch drafts
    decoder = build_batched_decoder(target, draft, "cascade", k, 3, target_curve=FLAT_VERIFY, draft_curve=CHEAP_DRAFT)
    results = decoder.generate_many(requests)
    identical = [result.tokens == tokens for result, tokens in zip(results, alone)]
    assert sum(identical) == len(requests), [(r.tokens, t) for r, t in zip(results, alone)]
    assert sum(result.stats.accepted for result in results) > 0
