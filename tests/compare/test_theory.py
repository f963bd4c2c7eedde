"""The pure pieces of the benchmark: the theory's formula, the lossless comparison, the run order."""

import pytest

from specdec_cli.bench import (
    BASELINE, DRAFT, HF_ASSISTED, HF_LOOKUP, PLAIN_DRAFT, SPECDEC, configurations, cut_at_eos, expected_speedup,
    identical_prompts, run_order,
)


def test_expected_speedup_on_hand_values():
    # (1 - 0.8^5) / ((1 - 0.8)(4 * 0.2 + 1)) = 0.67232 / 0.36
    assert expected_speedup(0.8, 4, 0.2) == pytest.approx(1.867555, abs=1e-6)
    assert expected_speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # 1 + 0.5 + 0.25 tokens per step, free drafts
    assert expected_speedup(0.0, 4, 0.25) == pytest.approx(0.5)  # nothing accepted: pay for 4 drafts per token


def test_expected_speedup_at_full_acceptance_is_the_limit():
    assert expected_speedup(1.0, 4, 0.2) == pytest.approx(5 / 1.8)
    assert expected_speedup(0.999999, 4, 0.2) == pytest.approx(5 / 1.8, rel=1e-5)


def test_expected_speedup_refuses_an_impossible_rate():
    with pytest.raises(ValueError):
        expected_speedup(1.2, 4, 0.2)


def test_identical_prompts_counts_only_token_exact_matches():
    baseline = {(0, 0): [5, 6, 7], (1, 0): [8, 9], (2, 0): [1, 2, 3]}
    other = {(0, 0): [5, 6, 7], (1, 0): [8, 4], (2, 0): [1, 2]}
    assert identical_prompts(baseline, other) == (1, 3)  # a changed token and a shorter output both count as different


def test_identical_prompts_needs_every_repeat_to_match():
    baseline = {(0, 0): [1], (0, 1): [1], (1, 0): [2], (1, 1): [2]}
    other = {(0, 0): [1], (0, 1): [3], (1, 0): [2], (1, 1): [2]}
    assert identical_prompts(baseline, other) == (1, 2)


def test_cut_at_eos_keeps_the_first_eos_and_drops_the_rest():
    assert cut_at_eos([4, 5, 2, 7, 2], (2, 9)) == [4, 5, 2]
    assert cut_at_eos([4, 5], (2,)) == [4, 5]


def test_run_order_is_prompt_major_and_rotates_the_first_configuration():
    order = run_order(n_prompts=3, repeats=1, n_configurations=3)
    assert order == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2),
        (1, 0, 1), (1, 0, 2), (1, 0, 0),
        (2, 0, 2), (2, 0, 0), (2, 0, 1),
    ]


def test_run_order_runs_every_repeat_of_a_prompt_before_the_next_prompt():
    order = run_order(n_prompts=2, repeats=2, n_configurations=2)
    assert [(prompt, repeat) for prompt, repeat, _ in order] == [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    assert sorted(order) == sorted({(p, r, c) for p in range(2) for r in range(2) for c in range(2)})


def test_configurations_are_the_baseline_then_drafters_times_k_then_hf():
    configs = configurations(["model", "ngram", "model"], [2, "auto", 0, 2], with_hf=True, has_draft=True)
    assert [(c.kind, c.drafter, c.k) for c in configs] == [
        (BASELINE, "none", 0),
        (SPECDEC, "model", 2), (SPECDEC, "model", "auto"),
        (SPECDEC, "ngram", 2), (SPECDEC, "ngram", "auto"),
        (HF_ASSISTED, "none", 0), (HF_LOOKUP, "none", 0),
    ]
    assert len({c.name for c in configs}) == len(configs)


def test_a_new_drafter_name_passes_through_untouched():
    configs = configurations(["cascade"], [4], with_hf=False, has_draft=True)
    assert [(c.drafter, c.k) for c in configs] == [("none", 0), ("cascade", 4)]


def test_without_a_draft_model_hf_runs_prompt_lookup_only():
    configs = configurations(["ngram"], [4], with_hf=True, has_draft=False)
    assert [c.kind for c in configs] == [BASELINE, SPECDEC, HF_LOOKUP]


def test_a_draft_quantised_by_specdec_gives_hf_assisted_both_drafts():
    configs = configurations(["cascade"], [3], with_hf=True, has_draft=True, plain_draft="int8")
    hf = [(c.name, c.assistant) for c in configs if c.kind == HF_ASSISTED]
    assert hf == [("HF assisted", PLAIN_DRAFT), ("HF assisted (int8 draft)", DRAFT)]
    assert len({c.name for c in configs}) == len(configs)
