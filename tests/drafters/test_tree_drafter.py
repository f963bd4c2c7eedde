"""The tree drafter: greedy output equals the target alone for any budget and branching; the tree it
grows keeps the budget (also in the middle of a level); its cache keeps the accepted branch."""

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, make_generator
from specdec_cli.engine.draft import DraftRule
from specdec_cli.engine.policy import DraftOrNot
from specdec_cli.engine.tree import depths

from tests.conftest import hf_greedy

PROMPT = [1, 5, 7, 9, 11]


@pytest.mark.parametrize("budget, branching", [(1, 1), (3, 2), (7, 3), (16, 2), (24, 4)])
def test_greedy_tree_output_equals_the_target_alone(llama_target, llama_near_draft, budget, branching):
    decoder = SpeculativeDecoder(llama_target, TreeDrafter(llama_near_draft, budget, branching), FixedK(6))
    result = decoder.generate(PROMPT, max_new_tokens=40)
    assert result.tokens == hf_greedy(llama_target, PROMPT, 40)
    if branching == 1:  # never a branch: every step's tree is a chain, verified as one
        assert result.stats.tree_steps == 0 and result.stats.drafted > 0
    else:
        assert result.stats.tree_steps > 0 and 0 < result.stats.tree_accepted <= result.stats.tree_nodes


def test_a_tree_without_branches_is_proposed_as_a_chain(llama_near_draft):
    draft = TreeDrafter(llama_near_draft, budget=4, branching=1).propose(PROMPT, 4, SamplingParams(), make_generator(0))
    assert len(draft) == 4 and draft.parents is None


def test_greedy_tree_output_equals_the_target_alone_on_qwen2(qwen_target, qwen_draft):
    decoder = SpeculativeDecoder(qwen_target, TreeDrafter(qwen_draft, 10, 3), FixedK(4))
    assert decoder.generate(PROMPT, max_new_tokens=30).tokens == hf_greedy(qwen_target, PROMPT, 30)


def test_the_budget_cuts_a_level_short_and_levels_come_one_forward_each(llama_near_draft):
    drafter = TreeDrafter(llama_near_draft, budget=5, branching=2)
    draft = drafter.propose(PROMPT, 8, SamplingParams(), make_generator(0))
    # roots 2, level 1: both roots expanded -> the first gets 2 children, the second the last 1.
    assert len(draft) == 5 and depths(draft.parents) == [0, 0, 1, 1, 1]
    assert draft.parents[2:] in ([0, 0, 1], [1, 1, 0])
    assert drafter.runner.forwards == 2  # the sequence, then the whole first level in one forward


def test_children_are_the_draft_top_tokens_most_probable_first(llama_near_draft):
    drafter = TreeDrafter(llama_near_draft, budget=3, branching=3)
    draft = drafter.propose(PROMPT, 4, SamplingParams(), make_generator(0))
    with torch.no_grad():
        logits = llama_near_draft(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert draft.ids == torch.topk(logits, 3).indices.tolist() and draft.parents == [-1, -1, -1]


def test_update_keeps_the_accepted_branch_in_the_draft_cache(llama_near_draft):
    drafter = TreeDrafter(llama_near_draft, budget=6, branching=2)
    draft = drafter.propose(PROMPT, 3, SamplingParams(), make_generator(0))
    second_root = draft.parents.index(-1, 1)
    child = draft.parents.index(second_root)
    accepted = [draft.ids[second_root], draft.ids[child]]
    drafter.update(PROMPT + accepted + [42], len(draft), 2)
    cached = drafter.runner.ids
    assert cached[: len(PROMPT) + 1] == PROMPT + accepted[:1] and drafter.runner.tree_nodes == []
    assert all(layer.keys.shape[-2] == len(cached) for layer in drafter.runner.cache.layers)
    logits = drafter.runner.extend(PROMPT + accepted + [42], 1)
    with torch.no_grad():
        expected = llama_near_draft(input_ids=torch.tensor([PROMPT + accepted + [42]])).logits[0, -1:]
    assert torch.allclose(logits, expected, atol=1e-5)


def test_sampling_children_are_drawn_from_the_draft_distribution_with_their_rows(llama_near_draft):
    drafter = TreeDrafter(llama_near_draft, budget=6, branching=2)
    draft = drafter.propose(PROMPT, 3, SamplingParams(temperature=1.0), make_generator(1))
    assert draft.probs is not None and draft.probs.shape[0] == len(draft) == 6
    assert torch.allclose(draft.probs.sum(-1), torch.ones(6), atol=1e-4)
    assert all(float(draft.probs[node, token]) > 0 for node, token in enumerate(draft.ids))


def test_bad_sizes_are_refused(llama_near_draft):
    with pytest.raises(ValueError):
        TreeDrafter(llama_near_draft, budget=0)


def test_a_windowed_tree_reads_the_last_tokens_and_keeps_its_branch(llama_near_draft):
    """With a window the tree's draft cache holds the window's tokens only, and `update` still finds the branch
    the sequence took (the ids it gets are the whole sequence's): the next step extends that cache."""
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(40)]
    drafter = TreeDrafter(llama_near_draft, budget=6, branching=2, window=16)
    draft = drafter.propose(prompt, 3, SamplingParams(), make_generator(0))
    assert drafter.runner.ids == prompt[-16:]
    child = draft.parents.index(0)
    accepted = [draft.ids[0], draft.ids[child]]
    drafter.update(prompt + accepted + [42], len(draft), 2)
    assert drafter.runner.ids[:17] == prompt[-16:] + accepted[:1] and drafter.runner.tree_nodes == []  # the leaf was not fed
    forwards = drafter.runner.forwards
    drafter.propose(prompt + accepted + [42], 1, SamplingParams(), make_generator(0))
    assert drafter.runner.forwards == forwards + 1 and drafter.runner.ids[0] == prompt[-16]  # extended, not refilled


def test_greedy_output_with_a_windowed_tree_equals_the_target_alone(llama_target, llama_near_draft):
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(40)]
    decoder = SpeculativeDecoder(llama_target, TreeDrafter(llama_near_draft, 8, 2, window=8), FixedK(4))
    result = decoder.generate(prompt, max_new_tokens=40)
    assert result.tokens == hf_greedy(llama_target, prompt, 40)
    assert result.stats.tree_accepted > 0


# Grown by value: the policy's rule (a branch cut) decides the shape; the budget only caps it.

def _value_tree(model, min_survival: float, branch_cut: float, budget: int = 32, branching: int = 2) -> TreeDrafter:
    drafter = TreeDrafter(model, budget=budget, branching=branching, max_depth=20)
    drafter.obey(DraftRule(min_survival=min_survival, branch_cut=branch_cut))
    return drafter


@pytest.mark.parametrize("min_survival", [0.05, 0.3, 0.6])
def test_without_branches_a_value_tree_is_the_chain_the_model_drafter_drafts(llama_near_draft, min_survival):
    chain = DraftModelDrafter(llama_near_draft)
    chain.obey(DraftRule(min_survival=min_survival))
    tree = _value_tree(llama_near_draft, min_survival, branch_cut=1.0)  # no further child reaches odds of 1
    for prompt in (PROMPT, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8]):
        expected = chain.propose(prompt, 12, SamplingParams(), make_generator(0)).ids
        draft = tree.propose(prompt, 12, SamplingParams(), make_generator(0))
        assert draft.ids == expected and draft.parents is None  # a chain, verified as one


def test_a_further_child_goes_in_exactly_where_its_path_odds_reach_the_cut(llama_near_draft):
    with torch.no_grad():
        probs = torch.softmax(llama_near_draft(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    top = torch.topk(probs, 3)
    second = float(top.values[1])
    # the roots: the top token always, the second where its odds reach the cut; nothing is drafted on (survival 1.0)
    below = _value_tree(llama_near_draft, 1.0, branch_cut=second * 1.01, branching=3)
    assert below.propose(PROMPT, 4, SamplingParams(), make_generator(0)).ids == top.indices[:1].tolist()
    above = _value_tree(llama_near_draft, 1.0, branch_cut=second * 0.99, branching=3)
    expected = top.indices[:2 if float(top.values[2]) < second * 0.99 else 3].tolist()
    assert above.propose(PROMPT, 4, SamplingParams(), make_generator(0)).ids == expected


def test_a_level_is_drafted_on_by_its_best_node_and_its_others_ride_where_they_reach_the_feed_cut(llama_near_draft):
    with torch.no_grad():
        probs = torch.softmax(llama_near_draft(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    (first, second), _ = torch.topk(probs, 2)
    first, second = float(first), float(second)
    assert first > second * 1.05  # the tiny draft is not tied here: the cuts below fall between them

    def children_of_roots(survival: float, feed: float | None) -> tuple[int, int]:
        drafter = TreeDrafter(llama_near_draft, budget=32, branching=2, max_depth=20)
        drafter.obey(DraftRule(min_survival=survival, branch_cut=second * 0.99, feed_cut=feed))
        draft = drafter.propose(PROMPT, 2, SamplingParams(), make_generator(0))  # two levels: roots, their children
        assert draft.parents[:2] == [-1, -1]  # both roots are in (the branch cut lets the second in)
        return draft.parents.count(0), draft.parents.count(1)

    between = (first * second) ** 0.5  # the first root's odds reach it, the second's do not
    assert children_of_roots(between, None)[1] == 0  # without a feed cut every fed node needs min_survival
    assert children_of_roots(between, second * 1.01)[1] == 0
    with_second = children_of_roots(between, second * 0.99)
    assert with_second[0] >= 1 and with_second[1] >= 1  # the second root rides in the first's forward
    assert children_of_roots(first * 1.01, 1e-6) == (0, 0)  # no root pays for the forward: nothing is fed


def test_grown_by_value_a_node_takes_up_to_value_branching_children_and_a_budget_tree_keeps_two(llama_near_draft):
    from specdec_cli.drafters.tree import DEFAULT_BRANCHING, VALUE_BRANCHING

    by_value = TreeDrafter(llama_near_draft, budget=32, max_depth=20)
    by_value.obey(DraftRule(min_survival=1.0, branch_cut=1e-9))  # every child's odds reach the cut; none fed on
    assert len(by_value.propose(PROMPT, 4, SamplingParams(), make_generator(0))) == VALUE_BRANCHING == 4
    budget = TreeDrafter(llama_near_draft, budget=3, max_depth=1)
    assert len(budget.propose(PROMPT, 4, SamplingParams(), make_generator(0))) == DEFAULT_BRANCHING == 2


def test_a_value_tree_branches_where_the_draft_hesitates_and_keeps_its_cap(llama_near_draft):
    draft = _value_tree(llama_near_draft, 0.05, branch_cut=0.05).propose(PROMPT, 12, SamplingParams(), make_generator(0))
    scores = _path_odds(llama_near_draft, PROMPT, draft)
    assert len(set(draft.parents)) < len(draft)  # some node has two children
    assert all(score >= 0.05 - 1e-6 for node, score in enumerate(scores) if not _is_first_child(draft, node))
    capped = _value_tree(llama_near_draft, 0.0, branch_cut=0.0, budget=7).propose(PROMPT, 12, SamplingParams(),
                                                                                  make_generator(0))
    assert len(capped) == 7


@pytest.mark.parametrize("budget, cut", [(32, 0.1), (32, 0.02), (5, 0.05)])
def test_greedy_output_with_a_value_tree_equals_the_target_alone(llama_target, llama_near_draft, budget, cut):
    drafter = _value_tree(llama_near_draft, 0.2, branch_cut=cut, budget=budget)
    result = SpeculativeDecoder(llama_target, drafter, FixedK(12)).generate(PROMPT, max_new_tokens=40)
    assert result.tokens == hf_greedy(llama_target, PROMPT, 40)
    assert result.stats.tree_nodes > result.stats.tree_steps  # it drafted more than one node a step


def test_the_cost_model_hands_a_tree_its_branch_cut_from_measured_costs():
    policy = DraftOrNot(max_k=20, rule=DraftRule(min_survival=0.3, branch_cut=0.15),
                        verify_curve={1: 0.030, 2: 0.036, 4: 0.038, 8: 0.050, 16: 0.090})
    assert policy.rule.branch_cut == 0.15  # nothing measured yet: the rule's own
    for _ in range(6):
        policy.update(3, 2, 0.030, 0.038)
    slope = (policy.verify.at(9) - policy.verify.at(1)) / 8
    assert policy.rule.branch_cut == pytest.approx(slope * policy.best_model_rate())
    assert DraftOrNot(max_k=20, rule=DraftRule(min_survival=0.3)).rule.branch_cut is None  # chains: none asked


def test_the_cost_model_hands_a_tree_its_feed_cut_from_the_draft_and_verify_slopes():
    verify = {1: 0.030, 2: 0.036, 4: 0.038, 8: 0.050, 16: 0.090}
    draft = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.016}
    policy = DraftOrNot(max_k=20, rule=DraftRule(min_survival=0.3, branch_cut=0.15), verify_curve=verify,
                        draft_curve=draft)
    assert policy.rule.feed_cut is None  # nothing measured yet: every fed node needs min_survival
    for _ in range(6):
        policy.update(3, 2, 0.030, 0.038)
    slope = (policy.verify.at(9) - policy.verify.at(1)) / 8
    row = policy.draft_cost.value * (0.013 / 0.010 - 1) / 4  # the draft curve: 5 rows cost 0.013 (4 to 8, linear)
    expected = (row + slope) * policy.best_model_rate() / policy.next_acceptance()
    assert policy.rule.feed_cut == pytest.approx(min(expected, policy.rule.min_survival))
    assert policy.rule.feed_cut < policy.rule.min_survival  # a row of a forward that runs anyway costs less
    unshaped = DraftOrNot(max_k=20, rule=DraftRule(min_survival=0.3, branch_cut=0.15), verify_curve=verify)
    for _ in range(6):
        unshaped.update(3, 2, 0.030, 0.038)
    growth = (unshaped.verify.at(5) / unshaped.verify.at(1) - 1) / 4  # no draft curve: the verify's shape
    expected = (unshaped.draft_cost.value * growth + slope) * unshaped.best_model_rate() / unshaped.next_acceptance()
    assert unshaped.rule.feed_cut == pytest.approx(min(expected, unshaped.rule.min_survival))
    chains = DraftOrNot(max_k=20, rule=DraftRule(min_survival=0.3), draft_curve=draft)
    for _ in range(6):
        chains.update(3, 2, 0.030, 0.038)
    assert chains.rule.feed_cut is None  # chains: none asked


def _path_odds(model, prompt, draft) -> list[float]:
    """Each node's path odds under the draft model, by plain forwards along each path."""
    odds = []
    for node in range(len(draft)):
        path, at = [], node
        while at >= 0:
            path.insert(0, at)
            at = draft.parents[at]
        value, sequence = 1.0, list(prompt)
        for step in path:
            with torch.no_grad():
                probs = torch.softmax(model(input_ids=torch.tensor([sequence])).logits[0, -1].float(), -1)
            value *= float(probs[draft.ids[step]])
            sequence.append(draft.ids[step])
        odds.append(value)
    return odds


def _is_first_child(draft, node) -> bool:
    return draft.parents.index(draft.parents[node]) == node


def test_a_subset_head_tree_drafts_subset_ids_with_full_vocabulary_rows(llama_target, llama_near_draft):
    vocab = llama_near_draft.config.vocab_size
    subset = torch.arange(0, vocab, 2)  # every other id
    drafter = TreeDrafter(llama_near_draft, budget=6, branching=2, token_ids=subset)
    draft = drafter.propose(PROMPT, 3, SamplingParams(temperature=1.0), make_generator(3))
    assert len(draft) == 6 and all(token % 2 == 0 for token in draft.ids)
    assert draft.probs.shape == (6, vocab) and float(draft.probs[:, 1::2].abs().sum()) == 0.0
    assert torch.allclose(draft.probs.sum(-1), torch.ones(6), atol=1e-4)
    decoder = SpeculativeDecoder(llama_target, _value_tree_on(llama_near_draft, subset), FixedK(12))
    result = decoder.generate(PROMPT, max_new_tokens=40)
    assert result.tokens == hf_greedy(llama_target, PROMPT, 40) and result.stats.accepted > 0


def _value_tree_on(model, subset) -> TreeDrafter:
    drafter = TreeDrafter(model, budget=32, branching=2, max_depth=20, token_ids=subset)
    drafter.obey(DraftRule(min_survival=0.2, branch_cut=0.05))
    return drafter
