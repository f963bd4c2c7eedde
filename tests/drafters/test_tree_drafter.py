"""The tree drafter: greedy output equals the target alone for any budget and branching; the tree it
grows keeps the budget (also in the middle of a level); its cache keeps the accepted branch."""

import pytest
import torch

from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, make_generator
from specdec_cli.engine.tree import depths

from tests.conftest import hf_greedy

PROMPT = [1, 5, 7, 9, 11]


@pytest.mark.parametrize("budget, branching", [(1, 1), (3, 2), (7, 3), (16, 2), (24, 4)])
def test_greedy_tree_output_equals_the_target_alone(llama_target, llama_near_draft, budget, branching):
    decoder = SpeculativeDecoder(llama_target, TreeDrafter(llama_near_draft, budget, branching), FixedK(6))
    result = decoder.generate(PROMPT, max_new_tokens=40)
    assert result.tokens == hf_greedy(llama_target, PROMPT, 40)
    assert result.stats.tree_steps > 0 and 0 < result.stats.tree_accepted <= result.stats.tree_nodes


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
