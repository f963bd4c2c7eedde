"""The batch policy: each row's k from its own acceptance and the cost of a step of B rows like it — drafting
where a batch's verify is flat, k = 0 once B (k + 1) tokens leave the flat stretch, and nothing in a row's k
from its batch mates (so a sampled row draws alike in any batch)."""

import pytest

from specdec_cli.engine.batch_policy import LOOKUP, MODEL, CostBatchK, FixedBatchK, RowPlan

# What `specdec calibrate` measured here (AMD EPYC, AVX512-BF16, 2 threads): the demo target in int8, the draft in int4.
TARGET = {1: 0.093, 2: 0.109, 4: 0.096, 8: 0.119, 16: 0.161}
DRAFT = {1: 0.029, 2: 0.032, 4: 0.041, 8: 0.069, 16: 0.119}
FRESH = RowPlan(room=100, source=MODEL)


def accepting(policy: CostBatchK, row: int, drafted: int, accepted: int, times: int) -> None:
    for _ in range(times):
        policy.update(row, drafted, accepted, MODEL)


@pytest.mark.parametrize("batch_size, drafts", [(1, True), (2, True), (8, False), (16, False)])
def test_rows_draft_while_the_batch_verify_is_flat_and_stop_past_it(batch_size, drafts):
    policy = CostBatchK(batch_size, TARGET, DRAFT)
    accepting(policy, 0, 4, 3, 10)  # a row whose drafts mostly survive
    assert (policy.plan({0: FRESH})[0] > 0) is drafts


def test_a_row_that_accepts_more_drafts_further():
    policy = CostBatchK(1, TARGET, DRAFT)
    accepting(policy, 0, 6, 6, 10)
    accepting(policy, 1, 6, 1, 10)
    ks = policy.plan({0: FRESH, 1: FRESH})
    assert ks[0] > ks[1]


def test_a_rows_k_does_not_depend_on_its_batch_mates():
    alone, crowded = CostBatchK(4, TARGET, DRAFT), CostBatchK(4, TARGET, DRAFT)
    for policy in (alone, crowded):
        accepting(policy, 0, 4, 2, 5)
    accepting(crowded, 1, 8, 8, 20)
    plans = [alone.plan({0: FRESH})[0]]
    plans.append(crowded.plan({0: FRESH, 1: FRESH, 2: RowPlan(3, LOOKUP)})[0])
    assert plans[0] == plans[1]


def test_a_long_catch_up_makes_drafting_dearer():
    policy = CostBatchK(1, TARGET, DRAFT)
    accepting(policy, 0, 4, 2, 10)
    caught_up = policy.plan({0: FRESH})[0]
    assert caught_up > 0 and policy.plan({0: RowPlan(100, MODEL, catch_up=400)})[0] == 0


def test_the_draft_prefills_with_the_prompt_only_where_fresh_rows_draft():
    assert CostBatchK(1, TARGET, DRAFT).drafts_from_the_start()
    assert not CostBatchK(16, TARGET, DRAFT).drafts_from_the_start()
    assert FixedBatchK(3).drafts_from_the_start() and not FixedBatchK(0).drafts_from_the_start()


def test_a_row_probes_now_and_then_where_drafting_could_pay():
    policy = CostBatchK(2, TARGET, DRAFT, probe_every=4)
    accepting(policy, 0, 4, 0, 30)  # nothing accepted: k = 0, but a probe every 4th step
    assert [policy.plan({0: FRESH})[0] for _ in range(8)] == [0, 0, 0, 2, 0, 0, 0, 2]
    never = CostBatchK(16, TARGET, DRAFT, probe_every=4)  # past the flat stretch even at 95% acceptance
    accepting(never, 0, 4, 0, 30)
    assert [never.plan({0: FRESH})[0] for _ in range(8)] == [0] * 8


def test_a_probe_never_feeds_the_draft_model_a_prompt():
    """At batch 4 a row that never drafted would pay its whole prompt's draft prefill (~0.6 s on the demo draft)
    to probe two tokens: over 16 prompts that cost 21% of the run's speed. Rows the draft has seen still probe."""
    policy = CostBatchK(4, TARGET, DRAFT, probe_every=4)
    unseen, seen = RowPlan(100, MODEL, catch_up=120), RowPlan(100, MODEL, catch_up=9)
    assert [policy.plan({0: unseen})[0] for _ in range(8)] == [0] * 8
    accepting(policy, 1, 4, 0, 30)  # its drafts failed: k = 0, but probed
    assert [policy.plan({1: seen})[1] for _ in range(8)] == [0, 0, 0, 2, 0, 0, 0, 2]
    for _ in range(30):
        policy.update(2, 4, 0, LOOKUP)  # lookups that failed: k = 0, but probed (they feed the draft model nothing)
    assert [policy.plan({2: RowPlan(100, LOOKUP, catch_up=120)})[2] for _ in range(8)] == [0, 0, 0, 2, 0, 0, 0, 2]


def test_a_curve_not_measured_is_assumed_in_the_measured_ones_unit():
    """A calibrated target (seconds) beside an uncalibrated draft: the draft's assumed share (35% on a CPU, 30% on a
    GPU) is of the target's one-token forward, not 0.35 (a draft forward priced at three target forwards never
    drafts)."""
    for device, share in (("cpu", 0.35), ("cuda", 0.3)):
        target_only, draft_only = CostBatchK(1, TARGET, None, device=device), CostBatchK(1, None, DRAFT, device=device)
        assert target_only.draft.at(1) == pytest.approx(share * TARGET[1])
        assert draft_only.verify.at(1) == pytest.approx(DRAFT[1] / share)
        accepting(target_only, 0, 4, 3, 10)
        assert target_only.plan({0: FRESH})[0] > 0


@pytest.mark.parametrize("batch_size, drafts", [(1, True), (2, True), (4, False), (8, False), (16, False)])
def test_without_a_calibration_a_cpu_batch_prices_its_verify_as_cpus_measured_it(batch_size, drafts):
    """Not calibrated, on a CPU: a verify of B (k + 1) tokens priced as the demo target's q4 forwards grew on two CPU
    kinds (16 tokens ~2.7 of one), so a batch of 8 no longer drafts up to 12 a row from the start on a flat curve
    that no CPU has (it ran at x0.89 of the target alone at batch 8 on Intel Xeon AMX, its first steps drafting),
    while a row alone (or two) still drafts from its prior; on a GPU the assumed verify stays flat and a batch of 8 drafts."""
    assert CostBatchK(batch_size, None, None, device="cpu").drafts_from_the_start() is drafts
    assert CostBatchK(batch_size, None, None, device="cuda").drafts_from_the_start() is (batch_size <= 8)
