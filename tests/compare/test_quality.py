"""The quantised-vs-unquantised agreement that `compare` reports: identical prompts, first divergences."""

from specdec_cli.bench.quality import agreement, first_divergence


def test_first_divergence_is_the_first_differing_token_or_where_the_shorter_ends():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # one stopped early (an EOS the other did not emit)


def test_agreement_counts_identical_prompts_and_takes_the_median_divergence():
    reference = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 9, 9, 9], 3: [1, 1, 1, 1]}
    quantised = {0: [1, 2, 3, 4], 1: [5, 0, 7, 8], 2: [9, 9, 9, 0], 3: [0, 1, 1, 1], 4: [2]}  # prompt 4: no reference
    found = agreement(reference, quantised)
    assert (found["compared"], found["identical"], found["median_first_divergence"]) == (4, 1, 1)
    assert found["first_divergence"] == {"0": None, "1": 1, "2": 3, "3": 0}
    assert agreement(reference, reference)["median_first_divergence"] is None
