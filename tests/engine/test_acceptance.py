"""The acceptance rules on hand-built logits and probabilities."""

import pytest
import torch

from specdec_cli.engine.acceptance import greedy_verdict, sampling_verdict
from specdec_cli.engine.sampling import make_generator

from tests.stats import assert_follows, draw_counts


def logits_with_argmax(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_all_and_adds_bonus():
    verdict = greedy_verdict([3, 1, 4], logits_with_argmax([3, 1, 4, 5]))
    assert (verdict.accepted, verdict.next_token, verdict.is_bonus) == (3, 5, True)


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_replaces_first_mismatch_with_target_argmax(mismatch):
    target = [3, 1, 4, 5]
    draft = list(target[:3])
    draft[mismatch] = 0
    verdict = greedy_verdict(draft, logits_with_argmax(target))
    assert (verdict.accepted, verdict.next_token, verdict.is_bonus) == (mismatch, target[mismatch], False)


def test_greedy_without_draft_is_plain_argmax():
    verdict = greedy_verdict([], logits_with_argmax([2]))
    assert (verdict.accepted, verdict.next_token) == (0, 2)


def test_greedy_over_wider_target_vocab_can_emit_padded_ids():
    target_logits = logits_with_argmax([3, 7], vocab=8)  # id 7 exists only in the target's rows
    verdict = greedy_verdict([3], target_logits)
    assert (verdict.accepted, verdict.next_token) == (1, 7)


def test_sampling_accepts_when_draft_equals_target():
    probs = torch.tensor([[0.1, 0.2, 0.7], [0.3, 0.3, 0.4], [0.5, 0.25, 0.25]])
    generator = make_generator(0)
    for _ in range(200):
        verdict = sampling_verdict([2, 1], probs[:2], probs, generator)
        assert verdict.accepted == 2 and verdict.is_bonus


def test_sampling_always_rejects_a_token_the_target_cannot_emit():
    target = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    draft = torch.tensor([[0.0, 0.0, 1.0]])
    generator = make_generator(0)
    for _ in range(100):
        verdict = sampling_verdict([2], draft, target, generator)
        assert verdict.accepted == 0 and verdict.next_token in (0, 1)


TARGET = torch.tensor([0.05, 0.30, 0.02, 0.25, 0.08, 0.15, 0.10, 0.05])
DRAFT = torch.tensor([0.40, 0.02, 0.30, 0.03, 0.10, 0.05, 0.05, 0.05])


@pytest.mark.slow
@pytest.mark.parametrize("point_mass", [False, True])
def test_first_token_follows_target_distribution(point_mass):
    """20,000 seeded rounds: draft x ~ DRAFT, then the verdict's first token is distributed as TARGET,
    for a draft with probabilities and for the same draws treated as a point mass (n-gram)."""
    generator = make_generator(1234)
    target_probs = torch.stack([TARGET, TARGET])  # (k+1, V), k = 1

    def one_round() -> int:
        drafted = int(torch.multinomial(DRAFT, 1, generator=generator))
        draft_probs = None if point_mass else DRAFT[None]
        verdict = sampling_verdict([drafted], draft_probs, target_probs, generator)
        return drafted if verdict.accepted else verdict.next_token

    assert_follows(draw_counts(one_round, 20_000, len(TARGET)), TARGET)


@pytest.mark.slow
def test_padded_vocab_widths_stay_exact():
    """Draft over 6 ids, target over 8 (two padded rows with mass): still exactly the target."""
    draft = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
    target = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1])
    generator = make_generator(5)

    def one_round() -> int:
        drafted = int(torch.multinomial(draft, 1, generator=generator))
        verdict = sampling_verdict([drafted], draft[None], torch.stack([target, target]), generator)
        return drafted if verdict.accepted else verdict.next_token

    assert_follows(draw_counts(one_round, 20_000, 8), target)


# The check's power against realistic acceptance bugs: tests/engine/test_decode_sampling.py.
