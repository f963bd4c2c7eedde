"""The goodness-of-fit check itself (tests/stats.py), against simulated multinomial samples: a correct
sampler passes it, its TV ceiling is not loose, and its chi-square p-value is calibrated."""

import numpy as np
import pytest
import torch

from tests.stats import chi_square_p_value, fit_failure, total_variation, tv_ceiling

DISTRIBUTIONS = {
    "uniform-12": torch.full((12,), 1 / 12),
    "skewed-8": torch.tensor([0.05, 0.30, 0.02, 0.25, 0.08, 0.15, 0.10, 0.05]),
    "peaked-12": torch.softmax(torch.linspace(0, 6, 12), 0),
}
SIMULATIONS = 4000


def simulated_counts(probs: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """(SIMULATIONS, V) counts of n draws each from `probs`, all at once."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.multinomial(n, probs.double().numpy() / float(probs.sum()), size=SIMULATIONS)).double()


@pytest.mark.parametrize("n", [2_000, 20_000])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_a_correct_sampler_passes_and_the_tv_ceiling_is_not_loose(name, n):
    probs = DISTRIBUTIONS[name]
    counts = simulated_counts(probs, n)
    tvs = 0.5 * (counts / n - probs.double()).abs().sum(-1)  # (SIMULATIONS,)
    ceiling = tv_ceiling(probs, n)
    assert float(tvs.max()) < ceiling
    assert float(tvs.mean()) > ceiling / 3  # a correct sampler's typical TV is near the ceiling's scale
    assert float(tvs.mean()) == pytest.approx(tv_ceiling(probs, n, sigmas=0), rel=0.05)
    assert float(tvs.std()) == pytest.approx(tv_ceiling(probs, n, sigmas=1) - tv_ceiling(probs, n, sigmas=0), rel=0.2)
    failures = sum(fit_failure(row, probs) is not None for row in counts[:500])
    assert failures == 0


def test_the_ceiling_shrinks_with_the_sample_size():
    probs = DISTRIBUTIONS["uniform-12"]
    assert tv_ceiling(probs, 80_000) == pytest.approx(tv_ceiling(probs, 20_000) / 2)
    assert 0.02 < tv_ceiling(probs, 20_000) < 0.023


def test_the_chi_square_p_value_is_uniform_under_the_null():
    probs = DISTRIBUTIONS["skewed-8"]
    p_values = torch.tensor([chi_square_p_value(row, probs) for row in simulated_counts(probs, 20_000, seed=1)])
    for level in (0.05, 0.2, 0.5):
        assert float((p_values < level).double().mean()) == pytest.approx(level, abs=0.02)


def test_a_token_the_distribution_cannot_emit_fails_at_once():
    probs = torch.tensor([0.5, 0.5, 0.0])
    assert chi_square_p_value(torch.tensor([10.0, 10.0, 1.0]), probs) == 0.0
    assert fit_failure(torch.tensor([10_000.0, 10_000.0, 1.0]), probs) is not None


def test_a_small_shift_of_mass_is_caught_at_20000_draws():
    """A bias of 0.02 moved between two ids (TV 0.02) is caught; the same counts from the exact
    probabilities are not."""
    probs = DISTRIBUTIONS["uniform-12"].double()
    shifted = probs.clone()
    shifted[0] += 0.02
    shifted[1] -= 0.02
    exact_counts, shifted_counts = probs * 20_000, shifted * 20_000
    assert fit_failure(exact_counts, probs) is None
    assert fit_failure(shifted_counts, probs) is not None
    assert total_variation(shifted_counts, probs) == pytest.approx(0.02)
