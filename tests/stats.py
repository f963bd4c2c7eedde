"""A goodness-of-fit check for sampled tokens against exact probabilities."""

from collections.abc import Callable

import torch

# Reject at significance 1e-4 (chi-square), and also demand a small total-variation distance:
# with 20,000 draws over <= 16 ids the TV of a correct sampler stays well under 0.02.
P_VALUE_FLOOR = 1e-4
TV_CEILING = 0.025


def draw_counts(draw: Callable[[], int], n: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(n):
        counts[draw()] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    probs = probs.double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0  # a token with probability 0 was drawn
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    frequencies = counts / counts.sum()
    tv = 0.5 * float((frequencies - probs.double()).abs().sum())
    p_value = chi_square_p_value(counts, probs)
    assert p_value > P_VALUE_FLOOR and tv < TV_CEILING, f"p={p_value:.2e} tv={tv:.4f}"
