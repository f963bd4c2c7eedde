"""A goodness-of-fit check for sampled tokens against exact probabilities.

Two statistics, both must pass:
- Pearson's chi-square, rejected below P_VALUE_FLOOR;
- the total-variation distance between the empirical frequencies and the exact probabilities, rejected
  above `tv_ceiling(probs, n)`: the mean TV that a correct sampler shows at this sample size plus
  TV_SIGMAS of its standard deviation (normal approximation of each count; the TV's right tail is a
  little heavier than a normal one, hence 6 rather than 4 sigmas; `test_stats.py` checks the ceiling
  against simulated multinomial samples). At 20,000 draws over 12 ids that is about 0.022, while a correct
  sampler's TV is about 0.009 with a standard deviation of 0.002: a fixed ceiling would be loose at one
  sample size and wrong at another."""

from collections.abc import Callable
import math

import torch

P_VALUE_FLOOR = 1e-4
TV_SIGMAS = 6.0


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


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


def tv_ceiling(probs: torch.Tensor, n: int, sigmas: float = TV_SIGMAS) -> float:
    """Mean + `sigmas` standard deviations of the TV of n draws from `probs`. Each frequency deviates from
    p_i by about N(0, p_i (1 - p_i) / n); |N(0, s²)| has mean s·sqrt(2/π) and variance s²(1 - 2/π). The
    deviations are nearly independent over a dozen ids or more (slightly negatively correlated: they sum
    to 0), so the variances add."""
    variances = probs.double() * (1 - probs.double()) / n  # (V,)
    mean = 0.5 * math.sqrt(2 / math.pi) * float(variances.sqrt().sum())
    deviation = 0.5 * math.sqrt((1 - 2 / math.pi) * float(variances.sum()))
    return mean + sigmas * deviation


def fit_failure(counts: torch.Tensor, probs: torch.Tensor) -> str | None:
    """None when `counts` pass as draws from `probs`; otherwise what failed."""
    n = int(counts.sum())
    p_value, tv, ceiling = chi_square_p_value(counts, probs), total_variation(counts, probs), tv_ceiling(probs, n)
    if p_value > P_VALUE_FLOOR and tv < ceiling:
        return None
    return f"p={p_value:.2e} (floor {P_VALUE_FLOOR:.0e}), tv={tv:.4f} (ceiling {ceiling:.4f} at n={n})"


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    failure = fit_failure(counts, probs)
    assert failure is None, failure
