"""The drafting gate (engine/gate.py) and the batched engine under it: drafting stops where it measured slower than
the target alone and resumes where it pays again, at batch 1 and in a batch, on a clock that advances only by the
prices the test sets (so nothing depends on this machine); greedy outputs stay the target's own, a seeded sampled
row never follows the gate, and the reason reaches each row's stats."""

import sys
from types import SimpleNamespace

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.batched import BatchedDecoder, RowRequest
from specdec_cli.engine.gate import DraftingGate
from specdec_cli.session import make_policy

from tests.engine.test_batched import CHEAP_DRAFT, FLAT_VERIFY, prompts


def steps(gate: DraftingGate, rows: int, count: int, draft_rate: float, plain_rate: float) -> list[bool]:
    """`count` steps of `rows` rows at the given tokens per second of each choice; whether each drafted."""
    chosen = []
    for _ in range(count):
        drafting = gate.drafts(rows)
        rate = draft_rate if drafting else plain_rate
        gate.record(rows, drafting, rows * 2 if drafting else rows, (rows * 2 if drafting else rows) / rate)
        chosen.append(drafting)
    return chosen


def test_the_gate_stops_drafting_that_measures_slower_and_resumes_when_it_pays_again():
    gate = DraftingGate(longest_wait=48)
    losing = steps(gate, 8, 200, draft_rate=60.0, plain_rate=90.0)
    assert sum(losing[:6]) <= 3  # a fresh occupancy tries plain steps early
    assert sum(losing[-100:]) <= 6  # once judged, only the probes draft, ever more rarely
    assert gate.reason(8) == "drafting did not pay at batch 8: 60.0 vs 90.0 tok/s measured"
    paying = steps(gate, 8, 300, draft_rate=140.0, plain_rate=90.0)
    assert sum(paying[-100:]) >= 88  # drafting again, but for the probes without it (often at first)
    assert gate.reason(8) is None


def test_where_drafting_is_many_times_slower_its_probes_are_rare():
    """A probe's loss stays within a small share of the time between probes: 2% by default."""
    gate = DraftingGate()
    losing = steps(gate, 8, 3000, draft_rate=9.0, plain_rate=90.0)
    assert sum(losing[-2000:]) <= 3  # one probe (its switch and two steps) at most in 2,000 steps
    wasted = sum(16 / 9.0 - 16 / 90.0 for drafted in losing[100:] if drafted)
    assert wasted <= 0.03 * sum(8 / 90.0 for drafted in losing[100:] if not drafted)


def test_each_occupancy_is_judged_on_its_own_and_a_new_one_starts_from_the_nearest():
    gate = DraftingGate()
    steps(gate, 8, 100, draft_rate=60.0, plain_rate=90.0)
    assert not gate.drafts(7)  # a new occupancy next to one that did not pay starts without drafting
    small = steps(gate, 2, 200, draft_rate=50.0, plain_rate=30.0)
    assert sum(small[-100:]) >= 94 and gate.reason(2) is None  # at two rows drafting pays: it resumes there
    assert gate.reason(8) is not None


def test_the_first_drafting_step_after_plain_ones_is_not_counted_as_drafting():
    """It also feeds the draft model what it skipped: counting it made drafting look dearer than it is."""
    gate = DraftingGate(probe_every=2, probe_steps=2)
    gate.record(4, False, 4, 0.1)
    gate.record(4, True, 8, 100.0)  # the switch: catch-up priced in, not a drafting rate
    gate.record(4, True, 8, 0.1)
    assert gate._occupancies[4].rates["draft"].per_second == pytest.approx(80.0)


class Clock:
    """The engine's clock: seconds pass only when a model runs, at prices the test sets (per forward, per row)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Priced:
    """Prices a model's forwards on the clock: each costs `price` seconds plus `per_token` a token fed (a hook on
    its embedding, which every forward calls with the ids it feeds)."""

    def __init__(self, model: torch.nn.Module, clock: Clock, price: float, per_token: float) -> None:
        self.clock, self.price, self.per_token = clock, price, per_token
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._charge)

    def _charge(self, module, inputs) -> None:
        self.clock.now += self.price + self.per_token * inputs[0].numel()


def run_batch(target, draft, batch_size: int, price: float, requests: list[RowRequest], switch_at: int | None = None,
              longest_wait: int = 96):
    """The batched engine with k = auto and the gate on the priced clock; the draft's price drops fiftyfold
    after `switch_at` of the results are in (drafting pays again)."""
    clock = Clock()
    priced = [Priced(target, clock, 0.010, 0.0005), Priced(draft, clock, price, 0.0001)]
    decoder = BatchedDecoder(target, draft, "model", batch_size=batch_size, k="auto", verify_curve=FLAT_VERIFY,
                             draft_curve=CHEAP_DRAFT, gate=DraftingGate(longest_wait=longest_wait), clock=clock)
    results = {}
    try:
        for index, result in decoder.stream(requests):
            results[index] = result
            if switch_at is not None and len(results) == switch_at:
                priced[1].price /= 50
    finally:
        for model in priced:
            model.handle.remove()
    return [results[index] for index in range(len(requests))], decoder.gate


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_batch_stops_drafting_when_a_slowed_draft_does_not_pay_and_its_tokens_stay_the_targets(
        target, near_draft, batch_size):
    requests = [RowRequest(prompt, SamplingParams(), 48) for prompt in prompts(8, seed=11)]
    alone = BatchedDecoder(target, batch_size=batch_size).generate_many(requests)
    slowed, _ = run_batch(target, near_draft, batch_size, price=0.200, requests=requests)
    assert [result.tokens for result in slowed] == [result.tokens for result in alone]
    held = sum(result.stats.held_steps for result in slowed)
    steps_taken = sum(result.stats.steps for result in slowed)
    assert held >= steps_taken * 0.7  # after the first probes, only probes draft
    reasons = {result.stats.policy for result in slowed if result.stats.held_steps}
    assert all(reason and reason.startswith("drafting did not pay at batch ") for reason in reasons), reasons


@pytest.mark.parametrize("batch_size", [1, 4])
def test_drafting_resumes_in_a_batch_when_the_draft_pays_again(target, near_draft, batch_size):
    requests = [RowRequest(prompt, SamplingParams(), 48) for prompt in prompts(12, seed=12)]
    results, gate = run_batch(target, near_draft, batch_size, price=0.200, requests=requests, switch_at=4,
                              longest_wait=16)
    early, late = results[:2], results[-2:]
    assert all(result.stats.held_steps for result in early)
    assert sum(result.stats.drafted_steps for result in late) >= 0.7 * sum(result.stats.steps for result in late)
    assert gate.reason(batch_size) is None


def test_a_seeded_sampled_row_drafts_as_the_batch_policy_says_whatever_the_gate_measured(target, near_draft):
    """Its draws depend on its drafts: the same seed must give the same record on every run, at any speed."""
    seeded = SamplingParams(temperature=0.8, seed=5)
    requests = [RowRequest(prompt, seeded, 32) for prompt in prompts(4, seed=13)]
    slow, _ = run_batch(target, near_draft, 2, price=0.200, requests=requests)
    fast, _ = run_batch(target, near_draft, 2, price=0.0001, requests=requests)
    assert [result.tokens for result in slow] == [result.tokens for result in fast]
    assert sum(result.stats.held_steps for result in slow) == 0
    assert sum(result.stats.drafted for result in slow) > 0


def test_one_sequence_at_a_time_the_cost_model_stops_a_slowed_draft_and_says_why(target, near_draft, monkeypatch):
    """Chat's policy (k = auto: the cost model on the clock) on the same priced clock: a dear draft is not used
    after the first measured steps, the reply is the target's own, and its stats say why."""
    clock = Clock()
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "time", SimpleNamespace(perf_counter=clock))
    priced = [Priced(target, clock, 0.010, 0.0005), Priced(near_draft, clock, 0.200, 0.0001)]
    try:
        prompt = prompts(1, seed=14)[0]
        decoder = SpeculativeDecoder(target, DraftModelDrafter(near_draft), make_policy("auto"))
        result = decoder.generate(prompt, SamplingParams(), 60)
    finally:
        for model in priced:
            model.handle.remove()
    alone = SpeculativeDecoder(target, None, FixedK(0)).generate(prompt, SamplingParams(), 60)
    assert result.tokens == alone.tokens
    assert result.stats.held_steps >= 0.6 * result.stats.steps
    assert result.stats.policy.startswith("drafting did not pay: ")
    assert result.stats.policy.endswith(" tok/s expected from the measured costs")
