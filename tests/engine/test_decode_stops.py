"""Stop conditions, provenance and per-step events."""

import copy

import pytest

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, Provenance, SamplingParams, SpeculativeDecoder

from tests.conftest import hf_greedy

PROMPT = [1, 5, 7, 9, 11]


@pytest.fixture(scope="module")
def reference(llama_target):
    return hf_greedy(llama_target, PROMPT, 40)


@pytest.mark.parametrize("max_new_tokens", [1, 3, 10, 13])
def test_max_new_tokens_is_never_exceeded(llama_target, reference, max_new_tokens):
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(llama_target), FixedK(7))
    result = decoder.generate(PROMPT, SamplingParams(), max_new_tokens)
    assert result.tokens == reference[:max_new_tokens]
    assert result.finish_reason == "length"


def test_eos_inside_an_accepted_draft_ends_generation(llama_target, reference):
    # Every draft is accepted (the target drafts for itself); pick an EOS that first appears mid-draft.
    position = next(i for i in range(3, 40) if reference[i] not in reference[:i])
    eos = reference[position]
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(llama_target), FixedK(7), eos_token_ids=[eos])
    result = decoder.generate(PROMPT, SamplingParams(), 40)
    assert result.tokens == reference[: position + 1]
    assert result.finish_reason == "stop"


def test_any_of_several_eos_ids_stops(llama_target, reference):
    first, second = reference[6], reference[3]
    assert second not in reference[:3]
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(llama_target), FixedK(4),
                                 eos_token_ids=[999, first, second])
    result = decoder.generate(PROMPT, SamplingParams(), 40)
    assert result.tokens == reference[:4] and result.finish_reason == "stop"


def test_stop_callback_ends_generation(llama_target, reference):
    decoder = SpeculativeDecoder(llama_target, None)
    result = decoder.generate(PROMPT, SamplingParams(), 40, stop=lambda generated: len(generated) >= 5)
    assert result.tokens == reference[:5] and result.finish_reason == "stop"


def test_events_carry_provenance_and_counts(llama_target, llama_near_draft):
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(llama_near_draft), FixedK(3))
    events = list(decoder.stream(PROMPT, SamplingParams(), 30))
    for event in events:
        assert len(event.tokens) == len(event.provenance) and 1 <= len(event.tokens) <= event.drafted + 1
        assert event.provenance[: event.accepted] == [Provenance.ACCEPTED] * event.accepted
    kinds = {p for event in events for p in event.provenance}
    assert {Provenance.ACCEPTED, Provenance.RESAMPLED} <= kinds
    assert sum(len(e.tokens) for e in events) == 30 and events[-1].finish_reason == "length"


def test_stats_count_positions(llama_target):
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(llama_target), FixedK(4))
    stats = decoder.generate(PROMPT, SamplingParams(), 21).stats
    # Four full steps of 4 drafts + bonus; the 21st token needs no draft (k is capped by the budget).
    assert stats.steps == 5 and stats.tokens_per_step == 21 / 5 and stats.acceptance_rate == 1.0
    assert stats.drafted_at == [4, 4, 4, 4] and stats.accepted_at == [4, 4, 4, 4]


def test_second_call_reuses_the_cached_prefix(llama_target, reference):
    """A second call that continues the first feeds each model only what it has not seen: the target's
    first forward of the second call carries the first call's last token and the new draft, not the
    whole sequence again."""
    draft = copy.deepcopy(llama_target)  # its own module, so the two models' forwards are told apart
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(draft), FixedK(4))
    first = decoder.generate(PROMPT, SamplingParams(), 10)
    fed = {"target": [], "draft": []}
    hooks = [model.register_forward_pre_hook(
        lambda module, args, kwargs, name=name: fed[name].append(kwargs["input_ids"].shape[-1]), with_kwargs=True)
        for name, model in (("target", llama_target), ("draft", draft))]
    try:
        second = decoder.generate(PROMPT + first.tokens, SamplingParams(), 10)
    finally:
        for hook in hooks:
            hook.remove()
    assert first.tokens + second.tokens == reference[:20]
    sequence_length = len(PROMPT) + len(first.tokens)
    assert fed["target"][0] <= 1 + 4 < sequence_length  # at most the unseen last token and 4 drafts
    assert fed["draft"][0] <= 2 < sequence_length  # the tokens the draft has not seen yet
    assert sum(fed["target"]) < sequence_length  # nothing of the first call was fed again
