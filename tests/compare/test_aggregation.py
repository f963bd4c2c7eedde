"""Table rows computed from hand-made runs: speedup, spread, acceptance by position, lossless count, theory."""

import pytest

from specdec_cli.bench import BASELINE, SPECDEC, Configuration, Run, summary_row, target_step_seconds

BASE = Configuration("target alone", BASELINE)
SPEC = Configuration("model k=2", SPECDEC, "model", 2)


def base_run(prompt, tokens, seconds):
    return Run("target alone", prompt, 0, tokens, seconds, steps=len(tokens), finish_reason="length", working_bytes=0,
               drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=seconds,
               prefill={"drafted": 0, "draft_seconds": 0.0, "verify_seconds": seconds / len(tokens)})


def spec_run(prompt, tokens, seconds, steps, drafted, accepted, drafted_at, accepted_at, draft_seconds, working=0):
    return Run("model k=2", prompt, 0, tokens, seconds, steps, "length", working, drafted, accepted, drafted_at,
               accepted_at, draft_seconds, seconds - draft_seconds,
               prefill={"drafted": 2, "draft_seconds": 0.1, "verify_seconds": 0.2})


BASELINE_RUNS = [base_run(0, [1, 2, 3, 4, 5, 6], 6.0), base_run(1, [7, 8, 9, 10, 11, 12], 3.0)]
SPEC_RUNS = [
    spec_run(0, [1, 2, 3, 4, 5, 6], 3.0, steps=3, drafted=6, accepted=3, drafted_at=[3, 3], accepted_at=[2, 1],
             draft_seconds=1.1, working=2048),
    spec_run(1, [7, 8, 9, 10, 11, 99], 2.0, steps=3, drafted=6, accepted=3, drafted_at=[3, 3], accepted_at=[2, 1],
             draft_seconds=0.9, working=1024),
]


def test_speedup_is_throughput_over_the_baselines_with_its_spread():
    row = summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=10_000)
    assert row["tokens_per_second"] == pytest.approx(12 / 5.0)
    assert row["speedup"] == pytest.approx((12 / 5.0) / (12 / 9.0))  # equal tokens: 9 s / 5 s
    assert (row["speedup_min"], row["speedup_max"]) == (pytest.approx(1.5), pytest.approx(2.0))
    assert row["median_tokens_per_second"] == pytest.approx((2.0 + 3.0) / 2)
    assert row["tokens_per_step"] == pytest.approx(2.0)


def test_acceptance_by_position_and_the_draft_share():
    row = summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=0)
    assert row["acceptance_rate"] == pytest.approx(0.5)
    assert row["acceptance_at"] == [pytest.approx(4 / 6), pytest.approx(2 / 6), None, None]
    assert row["draft_share"] == pytest.approx(2.0 / 5.0)


def test_the_policys_choices_per_configuration():
    """The share of steps that drafted and of those the policy held back (drafting measured slower), and why."""
    reason = "drafting did not pay: 9.0 vs 12.0 tok/s expected from the measured costs"
    held = [Run(**{**SPEC_RUNS[0].__dict__, "steps": 6, "held_steps": 3, "policy": reason}), SPEC_RUNS[1]]
    row = summary_row(SPEC, held, BASELINE_RUNS, greedy=True, memory_bytes=0)
    assert (row["drafted_steps"], row["held_steps"], row["policy"]) == (pytest.approx(6 / 9), pytest.approx(3 / 9),
                                                                        reason)
    assert summary_row(BASE, BASELINE_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=0)["drafted_steps"] == 0


def test_a_single_different_token_shows_in_the_identical_count():
    row = summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=0)
    assert (row["identical"], row["compared"]) == (1, 2)


def test_sampled_runs_have_no_identical_count():
    row = summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=False, memory_bytes=0)
    assert row["identical"] is None


def _with_first_step(run, seconds, tokens):
    return Run(**{**run.__dict__, "prefill": {**run.prefill, "seconds": seconds, "tokens": tokens}})


def test_the_first_step_and_the_decoding_after_it_are_apart():
    # baseline: first tokens after 1.5 s and 0.6 s, then 5 + 5 tokens in 4.5 + 2.4 s
    baseline = [_with_first_step(BASELINE_RUNS[0], 1.5, 1), _with_first_step(BASELINE_RUNS[1], 0.6, 1)]
    # speculative: its first steps (two prefills and a draft) 1.8 and 0.8 s gave 3 and 1 tokens, then 3 + 5 in 1.2 + 1.2
    spec = [_with_first_step(SPEC_RUNS[0], 1.8, 3), _with_first_step(SPEC_RUNS[1], 0.8, 1)]
    row = summary_row(SPEC, spec, baseline, greedy=True, memory_bytes=0)
    assert row["first_step_seconds"] == pytest.approx((1.8 + 0.8) / 2)
    assert row["decode_tokens_per_second"] == pytest.approx(8 / 2.4)
    assert row["decode_speedup"] == pytest.approx((8 / 2.4) / (10 / 6.9))
    assert summary_row(BASE, baseline, baseline, greedy=True, memory_bytes=0)["decode_speedup"] == pytest.approx(1.0)


def test_runs_that_do_not_say_when_their_first_step_ended_have_no_decoding_figures():
    # a JSON from before the first step's seconds were recorded; HF's peers have no first step at all
    row = summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=0)
    assert (row["first_step_seconds"], row["decode_tokens_per_second"], row["decode_speedup"]) == (None, None, None)


def test_memory_is_the_weights_plus_the_largest_working_peak():
    assert summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=10_000)["memory_bytes"] == 12_048


def test_the_baseline_row_has_no_drafting_columns_or_theory():
    row = summary_row(BASE, BASELINE_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=0)
    assert (row["speedup"], row["identical"], row["compared"]) == (pytest.approx(1.0), 2, 2)
    assert (row["acceptance_rate"], row["draft_share"], row["theory"]) == (None, None, None)


def test_theory_uses_the_runs_own_alpha_gamma_and_cost_ratio():
    # target step after prefill: (6 - 1) s / 5 steps and (3 - 0.5) s / 5 steps -> 7.5 s / 10 steps
    assert target_step_seconds(BASELINE_RUNS) == pytest.approx(0.75)
    theory = summary_row(SPEC, SPEC_RUNS, BASELINE_RUNS, greedy=True, memory_bytes=0)["theory"]
    draft_cost = (1.1 - 0.1 + 0.9 - 0.1) / (6 - 2 + 6 - 2)  # seconds per drafted token after the prefill step
    assert theory["alpha"] == pytest.approx(0.5)
    assert theory["gamma"] == pytest.approx(2.0)
    assert theory["c"] == pytest.approx(draft_cost / 0.75)
    expected = (1 - 0.5**3) / (0.5 * (2 * theory["c"] + 1))
    assert theory["expected_speedup"] == pytest.approx(expected)
    assert theory["efficiency"] == pytest.approx((9 / 5) / expected)


def test_theory_gives_lookup_steps_their_own_alpha_and_no_draft_cost():
    cascade = Configuration("cascade k=2", SPECDEC, "cascade", 2)
    # 6 steps: 3 model steps (6 drafted, 3 kept), 2 lookup steps (8 drafted, 4 kept), 1 plain step.
    run = Run("cascade k=2", 0, 0, list(range(14)), 3.0, 6, "length", 0, 14, 7, [5, 5], [3, 2], 1.1, 1.9,
              prefill={"drafted": 2, "draft_seconds": 0.1, "verify_seconds": 0.2, "free": False},
              lookup_steps=2, lookup_drafted=8, lookup_accepted=4)
    theory = summary_row(cascade, [run], BASELINE_RUNS[:1], greedy=True, memory_bytes=0)["theory"]
    model, lookup = theory["model"], theory["lookup"]
    assert (model["steps"], model["alpha"], model["gamma"]) == (4, pytest.approx(0.5), pytest.approx(1.5))
    assert (lookup["steps"], lookup["alpha"], lookup["gamma"]) == (2, pytest.approx(0.5), pytest.approx(4.0))
    c = ((1.1 - 0.1) / (6 - 2)) / 1.0  # model-drafted tokens after the prefill; the target's step is 5 s / 5 steps
    assert theory["c"] == pytest.approx(c)
    model_tokens = (1 - 0.5**2.5) / 0.5   # i.i.d. tokens per step at α 0.5, γ 1.5
    lookup_tokens = (1 - 0.5**5) / 0.5
    expected = (4 * model_tokens + 2 * lookup_tokens) / (4 * (1.5 * c + 1) + 2 * 1)
    assert theory["expected_speedup"] == pytest.approx(expected)


def test_theory_of_a_lookup_only_drafter_has_no_draft_cost():
    ngram = Configuration("ngram k=4", SPECDEC, "ngram", 4)
    run = Run("ngram k=4", 0, 0, list(range(8)), 3.0, 5, "length", 0, 4, 3, [1] * 4, [1] * 3, 0.001, 2.9,
              prefill={"drafted": 0, "draft_seconds": 0.0, "verify_seconds": 0.2, "free": False},
              lookup_steps=1, lookup_drafted=4, lookup_accepted=3)
    theory = summary_row(ngram, [run], BASELINE_RUNS[:1], greedy=True, memory_bytes=0)["theory"]
    assert theory["c"] == 0.0
    expected = (4 * 1 + 1 * (1 - 0.75**5) / 0.25) / 5  # 4 plain steps + one lookup step, each costing one target step
    assert theory["expected_speedup"] == pytest.approx(expected)
