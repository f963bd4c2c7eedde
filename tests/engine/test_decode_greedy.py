"""Greedy speculative decoding is token-identical to the target's own greedy decoding (fp32)."""

import pytest

from specdec_cli.drafters import DraftModelDrafter, NgramDrafter
from specdec_cli.engine import AdaptiveK, FixedK, Provenance, SamplingParams, SpeculativeDecoder

from tests.conftest import hf_greedy, tiny_causal_lm

SHORT_PROMPT = [1, 17]
LONG_PROMPT = [1] + [(7 * i + 3) % 90 + 3 for i in range(120)]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def references(llama_target):
    return {len(p): hf_greedy(llama_target, p, NEW_TOKENS) for p in (SHORT_PROMPT, LONG_PROMPT)}


def run(target, drafter, policy, prompt, max_new_tokens=NEW_TOKENS, eos=()):
    decoder = SpeculativeDecoder(target, drafter, policy, eos_token_ids=eos)
    return decoder.generate(prompt, SamplingParams(), max_new_tokens)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("draft_name", ["near", "different", "self"])
def test_draft_model_matches_hf_greedy(request, llama_target, references, k, prompt, draft_name):
    draft = {
        "near": request.getfixturevalue("llama_near_draft"),
        "different": request.getfixturevalue("llama_draft"),
        "self": llama_target,
    }[draft_name]
    result = run(llama_target, DraftModelDrafter(draft), FixedK(k), prompt)
    assert result.tokens == references[len(prompt)]
    if draft_name == "self":  # the target as its own draft: every draft accepted
        assert result.stats.accepted == result.stats.drafted > 0
        assert set(result.provenance) <= {Provenance.ACCEPTED, Provenance.BONUS}


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_ngram_drafter_matches_hf_greedy(llama_target, references, k, prompt):
    result = run(llama_target, NgramDrafter(max_n=3), FixedK(k), prompt)
    assert result.tokens == references[len(prompt)]
    assert result.stats.drafted > 0  # the lookup did find matches


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_adaptive_k_matches_hf_greedy(llama_target, llama_near_draft, references, prompt):
    result = run(llama_target, DraftModelDrafter(llama_near_draft), AdaptiveK(), prompt)
    assert result.tokens == references[len(prompt)]
    assert 0 < result.stats.accepted < result.stats.drafted  # both outcomes were exercised


def test_target_alone_matches_hf_greedy(llama_target, references):
    result = run(llama_target, None, None, LONG_PROMPT)
    assert result.tokens == references[len(LONG_PROMPT)]
    assert set(result.provenance) == {Provenance.TARGET} and result.stats.steps == NEW_TOKENS


def test_qwen2_pair_with_padded_target_vocab_matches_hf_greedy():
    """Target logits 104 wide, draft 96 wide, as Qwen2.5-7B (152064) vs 0.5B (151936)."""
    target = tiny_causal_lm("qwen2", vocab_size=104, seed=2, logit_scale=8.0)
    draft = tiny_causal_lm("qwen2", vocab_size=96, seed=3, hidden=32, logit_scale=8.0)
    reference = hf_greedy(target, LONG_PROMPT, NEW_TOKENS)
    for k in (1, 4):
        assert run(target, DraftModelDrafter(draft), FixedK(k), LONG_PROMPT).tokens == reference
