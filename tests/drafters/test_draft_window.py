"""The draft model's window: it reads only the last `window` tokens of the prompt it first sees and all that
follows, on one cache that every later step extends; a sequence that no longer holds the dropped tokens
sets the window anew; the output stays the target's own."""

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, make_generator

from tests.conftest import hf_greedy

PROMPT = [1] + [(7 * i + 2) % 60 + 3 for i in range(40)]


def test_the_draft_reads_the_last_window_tokens_and_extends_that_cache(llama_near_draft):
    drafter = DraftModelDrafter(llama_near_draft, window=16)
    generator = make_generator(0)
    draft = drafter.propose(PROMPT, 3, SamplingParams(), generator)
    assert drafter.runner.ids == PROMPT[-16:] + draft.ids[:2]  # the last draft token is not fed yet
    forwards = drafter.runner.forwards
    longer = PROMPT + draft.ids[:1] + [9]  # one draft token accepted, then the target's own
    drafter.propose(longer, 1, SamplingParams(), generator)
    assert drafter.runner.ids == longer[len(PROMPT) - 16:]  # the same start: the cache was extended, not refilled
    assert drafter.runner.forwards == forwards + 1


def test_a_sequence_without_the_dropped_tokens_sets_the_window_anew(llama_near_draft):
    drafter = DraftModelDrafter(llama_near_draft, window=16)
    generator = make_generator(0)
    drafter.propose(PROMPT, 1, SamplingParams(), generator)
    other = [1] + [(5 * i + 4) % 60 + 3 for i in range(30)]
    drafter.propose(other, 1, SamplingParams(), generator)
    assert drafter.runner.ids == other[-16:]
    drafter.reset()
    drafter.propose(PROMPT[:10], 1, SamplingParams(), generator)
    assert drafter.runner.ids == PROMPT[:10]  # shorter than the window: all of it


def test_speculation_with_a_windowed_draft_is_the_target_alone(llama_target, llama_near_draft):
    for drafter in (DraftModelDrafter(llama_near_draft, window=8),
                    CascadeDrafter(DraftModelDrafter(llama_near_draft, window=8))):
        result = SpeculativeDecoder(llama_target, drafter, FixedK(4)).generate(PROMPT, SamplingParams(), 40)
        assert result.tokens == hf_greedy(llama_target, PROMPT, 40)
        assert result.stats.accepted > 0
