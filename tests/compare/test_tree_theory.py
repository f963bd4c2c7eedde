"""The theory for trees: expected accepted tokens per step from the run's own acceptance per place in
the tree, counted by the engine's stats; compare's tree theory row from hand-made runs."""

import pytest
from rich.markup import escape

from specdec_cli.bench import SPECDEC, Configuration, Run, summary_row, theory_tables
from specdec_cli.bench.theory import expected_tree_accepted
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, GenerationStats, SpeculativeDecoder, StepEvent
from specdec_cli.engine.tree import addresses

from tests.compare.test_aggregation import BASELINE_RUNS

TREE = Configuration("tree k=3", SPECDEC, "tree", 3)
#        sequence
#        /      \
#      (0)      (1)
#     /   \       \
#  (0,0) (0,1)   (1,0)
#          |
#       (0,1,0)
PARENTS = [-1, -1, 0, 0, 1, 3]


def test_addresses_are_sibling_ranks_from_the_root():
    assert addresses(PARENTS) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0)]
    assert addresses([]) == [] and addresses([-1, 0, 1]) == [(0,), (0, 0), (0, 0, 0)]  # a chain


def tree_step(accepted_address: tuple[int, ...]) -> StepEvent:
    places = tuple(addresses(PARENTS))
    return StepEvent([7] * (len(accepted_address) + 1), [], 6, len(accepted_address), 0.0, 0.0, None,
                     tree_nodes=6, tree_depth=3, tree_addresses=places, tree_accepted_address=accepted_address)


def test_stats_count_each_place_present_reached_and_accepted():
    stats = GenerationStats()
    for accepted in [(0, 1, 0), (0, 1), (1,), ()]:
        stats.add_step(tree_step(accepted))
    assert stats.tree_places == {
        "0": [4, 4, 2], "1": [4, 4, 1],   # roots are always reached
        "0.0": [4, 2, 0], "0.1": [4, 2, 2], "1.0": [4, 1, 0],
        "0.1.0": [4, 2, 1],
    }
    assert (stats.tree_steps, stats.tree_nodes, stats.tree_accepted) == (4, 24, 6)
    merged = GenerationStats.total([stats, stats])
    assert merged.tree_places["0.1.0"] == [8, 4, 2] and merged.tree_steps == 8


def test_expected_accepted_is_the_sum_over_nodes_of_their_path_s_acceptance():
    # a(0) = 2/4, a(1) = 1/4, a(0.0) = 0, a(0.1) = 2/2, a(1.0) = 0, a(0.1.0) = 1/2
    places = {"0": [4, 4, 2], "1": [4, 4, 1], "0.0": [4, 2, 0], "0.1": [4, 2, 2], "1.0": [4, 1, 0], "0.1.0": [4, 2, 1]}
    expected = (0.5 + 0.25 + 0.5 * 0 + 0.5 * 1 + 0.25 * 0 + 0.5 * 1 * 0.5) * 4 / 4
    assert expected_tree_accepted(places, 4) == pytest.approx(expected)
    assert expected == pytest.approx((3 + 2 + 1 + 0) / 4)  # one tree shape throughout: the measured mean
    # A place missing from some trees counts only where it was drafted.
    assert expected_tree_accepted({"0": [4, 4, 2], "0.0": [2, 2, 1]}, 4) == pytest.approx((4 * 0.5 + 2 * 0.5 * 0.5) / 4)
    assert expected_tree_accepted({}, 0) == 0.0


def test_the_engine_counts_every_accepted_node_once(llama_target, llama_near_draft):
    decoder = SpeculativeDecoder(llama_target, TreeDrafter(llama_near_draft, budget=8, branching=2), FixedK(4))
    stats = decoder.generate([1, 5, 7, 9, 11], max_new_tokens=40).stats
    assert stats.tree_steps > 0 and sum(counts[2] for counts in stats.tree_places.values()) == stats.tree_accepted
    assert sum(counts[0] for counts in stats.tree_places.values()) == stats.tree_nodes
    assert all(counts[1] == counts[0] for place, counts in stats.tree_places.items() if "." not in place)  # roots
    assert all(counts[0] >= counts[1] >= counts[2] for counts in stats.tree_places.values())


def tree_run(prompt: int, tokens: int, seconds: float, draft_seconds: float) -> Run:
    """4 steps over PARENTS-shaped trees: accepted (0, 1, 0), (0, 1), (1,), () as above, 10 tokens."""
    stats = GenerationStats()
    for accepted in [(0, 1, 0), (0, 1), (1,), ()]:
        stats.add_step(tree_step(accepted))
    return Run("tree k=3", prompt, 0, list(range(tokens)), seconds, 4, "length", 0, 24, 6, [4, 4, 4], [3, 2, 1],
               draft_seconds, seconds - draft_seconds,
               prefill={"drafted": 6, "draft_seconds": 0.4, "verify_seconds": 0.5, "free": False},
               tree_steps=4, tree_nodes=24, tree_accepted=6, tree_places=stats.tree_places)


def test_the_tree_theory_row_uses_the_per_place_acceptance_and_the_drafting_cost_per_step():
    runs = [tree_run(0, 10, 2.0, 1.0)]
    row = summary_row(TREE, runs, BASELINE_RUNS[:1], greedy=True, memory_bytes=0)
    theory = row["theory"]
    assert theory["kind"] == "tree" and (row["tree_nodes_per_step"], row["tree_depth_per_step"]) == (6.0, 1.5)
    c = ((1.0 - 0.4) / 3) / 1.0  # drafting seconds per step after the prefill; the target's step is 5 s / 5 steps
    assert theory["c"] == pytest.approx(c)
    assert theory["expected_accepted"] == pytest.approx(1.5) and theory["accepted"] == pytest.approx(1.5)
    assert theory["expected_speedup"] == pytest.approx((1 + 1.5) / (c + 1))
    assert theory["efficiency"] == pytest.approx(row["speedup"] / theory["expected_speedup"])
    tables = theory_tables([row], {})
    assert [table.title for table in tables] == [escape("tree theory: expected = (1 + E[accepted]) / (c + 1)")]


def test_a_tree_drafters_chain_and_lookup_steps_count_with_their_own_acceptance():
    """The tree drafter also drafts chains (a confident draft) and lookups: E[accepted] weighs each kind of step by
    its share, instead of spreading the trees' expectation over every step (which put it far below what was
    accepted, and the efficiency over 100%)."""
    tree = tree_run(0, 21, 3.0, 1.0)
    run = Run(**{**tree.__dict__, "steps": 8, "drafted": 24 + 4 + 6, "accepted": 6 + 3 + 2, "lookup_steps": 2,
                 "lookup_drafted": 6, "lookup_accepted": 2})
    theory = summary_row(TREE, [run], BASELINE_RUNS[:1], greedy=True, memory_bytes=0)["theory"]
    chain = (1 - 0.75 ** 3) / (1 - 0.75) - 1  # 2 chain steps: 4 drafted, 3 accepted (α 3/4, γ 2)
    lookup = (1 - (1 / 3) ** 4) / (1 - 1 / 3) - 1  # 2 lookup steps: 6 drafted, 2 accepted (α 1/3, γ 3)
    assert theory["tree_share"] == pytest.approx(4 / 8)
    assert theory["expected_accepted"] == pytest.approx((4 * 1.5 + 2 * chain + 2 * lookup) / 8)
    assert theory["accepted"] == pytest.approx(11 / 8)
    c = ((1.0 - 0.4) / 7) / 1.0
    assert theory["expected_speedup"] == pytest.approx((1 + theory["expected_accepted"]) / (c + 1))
