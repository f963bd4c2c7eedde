"""Token trees: shape helpers, acceptance on hand-built logits, the tree forward and its commit."""

import pytest
import torch

from specdec_cli.engine import SamplingParams, SpeculativeDecoder
from specdec_cli.engine.draft import Draft, Drafter
from specdec_cli.engine.kv import CachedModel, tree_capable
from specdec_cli.engine.policy import FixedK
from specdec_cli.engine.tree import (
    ancestry, depth_first, depths, first_child_chain, greedy_tree_verdict, path_to, sampling_tree_verdict,
)

from tests.conftest import hf_greedy

#        sequence
#        /      \
#      0:a      1:b
#     /   \       \
#   2:c   3:d     4:e
#          |
#         5:f
PARENTS = [-1, -1, 0, 0, 1, 3]


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_shape_helpers():
    assert depths(PARENTS) == [0, 0, 1, 1, 1, 2]
    assert path_to(5, PARENTS) == [0, 3, 5] and path_to(-1, PARENTS) == []
    assert first_child_chain(PARENTS) == [0, 2]
    assert ancestry(PARENTS)[5].tolist() == [True, False, False, True, False, True]
    with pytest.raises(ValueError):
        depths([-1, 2, 0])


def one_hot_rows(wanted: list[int], vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(wanted), vocab).float() * 5.0


def test_greedy_walks_the_argmax_past_a_rejected_first_child():
    ids = [3, 4, 5, 6, 7, 8]  # a b c d e f
    # rows: after sequence -> a; after a -> d (the second child); after b -> -; after d -> f; after f -> 9
    wanted = [3, 6, 0, 0, 0, 0, 8]
    wanted[4] = 8  # after node 3 (d): f
    wanted[6] = 9  # after node 5 (f): the bonus
    verdict = greedy_tree_verdict(ids, PARENTS, one_hot_rows(wanted))
    assert verdict.path == [0, 3, 5] and verdict.next_token == 9 and verdict.is_bonus


def test_greedy_stops_with_a_correction_where_no_child_matches():
    ids = [3, 4, 5, 6, 7, 8]
    verdict = greedy_tree_verdict(ids, PARENTS, one_hot_rows([4, 0, 1, 0, 0, 0, 0]))
    assert verdict.path == [1] and verdict.next_token == 1 and not verdict.is_bonus


def test_sampling_point_masses_accept_the_second_sibling_by_the_renormalised_residual():
    # Target after the sequence: 0.5 on token 3 (a), 0.5 on token 4 (b). Point masses: a is accepted
    # with p = 0.5; after its rejection the residual is all on b, which is then always accepted.
    target = torch.zeros(7, 10)
    target[0, 3] = target[0, 4] = 0.5
    target[1:, 9] = 1.0
    seen = {0: 0, 1: 0}
    for seed in range(400):
        verdict = sampling_tree_verdict([3, 4, 5, 6, 7, 8], None, PARENTS, target, torch.Generator().manual_seed(seed))
        seen[verdict.path[0]] += 1
        assert len(verdict.path) == 1 and verdict.next_token == 9
    assert 150 < seen[0] < 250 and seen[0] + seen[1] == 400


class FixedTree(Drafter):
    """Proposes the same tree every step, whatever the sequence (for hand-made trees)."""

    name = "fixed-tree"

    def __init__(self, ids: list[int], parents: list[int]) -> None:
        self.tree = Draft(ids, None, parents)

    def propose(self, ids, k, params, generator) -> Draft:
        return self.tree


def test_tree_forward_scores_every_node_as_its_own_path(llama_target):
    runner = CachedModel(llama_target)
    prefix, tree_ids = [1, 5, 7, 9], [10, 11, 12, 13, 14, 15]
    logits = runner.extend_tree(prefix, tree_ids, PARENTS, sequence_logits=True)  # (T+1, V)
    assert torch.allclose(logits[0], full_forward_logits(llama_target, prefix)[-1], atol=1e-5)
    for node in range(len(tree_ids)):
        path = [tree_ids[step] for step in path_to(node, PARENTS)]
        assert torch.allclose(logits[node + 1], full_forward_logits(llama_target, prefix + path)[-1], atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_commit_leaves_the_cache_equal_to_a_plain_forward_over_the_accepted_path(arch, llama_target, qwen_target):
    model = llama_target if arch == "llama" else qwen_target
    runner = CachedModel(model)
    prefix, tree_ids = [1, 5, 7, 9], [10, 11, 12, 13, 14, 15]
    runner.extend(prefix[:2], 1)  # part of the prefix cached, the rest fed with the tree
    runner.extend_tree(prefix, tree_ids, PARENTS, sequence_logits=True)
    runner.keep_path([0, 3, 5])
    accepted = prefix + [10, 13, 15]
    assert runner.ids == accepted and runner.tree_nodes == []
    plain = CachedModel(model)
    plain.extend(accepted, 1)
    for mine, theirs in zip(runner.cache.layers, plain.cache.layers):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(mine.values, theirs.values, atol=1e-5)
    logits = runner.extend(accepted + [20, 21], 2)
    assert torch.allclose(logits, full_forward_logits(model, accepted + [20, 21])[-2:], atol=1e-5)


def test_a_drafter_grows_its_tree_over_several_forwards(llama_target):
    runner = CachedModel(llama_target)
    prefix, tree_ids = [1, 5, 7, 9], [10, 11, 12, 13, 14, 15]
    runner.extend(prefix, 1)
    runner.extend_tree(prefix, tree_ids[:2], PARENTS[:2], feed=[0, 1])
    logits = runner.extend_tree(prefix, tree_ids[:5], PARENTS[:5], feed=[3])  # node 3's parent 0 is cached
    assert runner.tree_nodes == [0, 1, 3] and runner.forwards == 3
    assert torch.allclose(logits[0], full_forward_logits(llama_target, prefix + [10, 13])[-1], atol=1e-5)
    runner.keep_path([0, 3, 5])  # node 5 was never fed: the branch is kept as far as it is cached
    assert runner.ids == prefix + [10, 13]


def test_an_interrupted_tree_forward_leaves_the_cache_consistent(llama_target, monkeypatch):
    runner = CachedModel(llama_target)
    runner.extend([1, 2, 3], 1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llama_target.model.layers[1], "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.extend_tree([1, 2, 3, 4], [10, 11, 12, 13, 14, 15], PARENTS, sequence_logits=True)
    monkeypatch.undo()
    assert runner.tree_nodes == [] and len(runner.ids) == len(runner.cache.layers[0].keys[0, 0])
    assert all(layer.keys.shape[-2] == len(runner.ids) for layer in runner.cache.layers)
    logits = runner.extend([1, 2, 3, 4, 5], 1)
    assert torch.allclose(logits, full_forward_logits(llama_target, [1, 2, 3, 4, 5])[-1:], atol=1e-5)


def test_a_pending_tree_is_dropped_by_the_next_chain_forward(llama_target):
    runner = CachedModel(llama_target)
    runner.extend_tree([1, 2, 3], [10, 11, 12, 13, 14, 15], PARENTS, sequence_logits=True)
    logits = runner.extend([1, 2, 3, 11, 12, 13], 3)  # 11 is a root, but the tree was never committed
    assert runner.ids == [1, 2, 3, 11, 12, 13]
    assert all(layer.keys.shape[-2] == 6 for layer in runner.cache.layers)
    assert torch.allclose(logits, full_forward_logits(llama_target, [1, 2, 3, 11, 12, 13])[-3:], atol=1e-5)


def test_a_best_path_through_a_later_sibling_gives_the_target_output(llama_target):
    prompt = [1, 5, 7, 9]
    expected = hf_greedy(llama_target, prompt, 3)
    wrong = [(token + 1) % 96 for token in expected]
    # Roots: a wrong token first, the right one second; under the right one, wrong then right again.
    tree = FixedTree([wrong[0], expected[0], wrong[1], expected[1]], [-1, -1, 1, 1])
    decoder = SpeculativeDecoder(llama_target, tree, FixedK(2))
    event = next(decoder.stream(prompt, max_new_tokens=3))
    assert event.tokens == expected and event.accepted == 2 and event.tree_nodes == 4 and event.tree_depth == 2
    assert [p.value for p in event.provenance] == ["accepted", "accepted", "bonus"]


def test_eos_inside_a_branch_stops_there(llama_target):
    prompt = [1, 5, 7, 9]
    expected = hf_greedy(llama_target, prompt, 4)
    eos = expected[1]
    tree = FixedTree([(expected[0] + 1) % 96, expected[0], expected[1], expected[2]], [-1, -1, 1, 2])
    decoder = SpeculativeDecoder(llama_target, tree, FixedK(3), eos_token_ids=[eos])
    result = decoder.generate(prompt, max_new_tokens=10)
    assert result.tokens == expected[:2] and result.finish_reason == "stop"


def test_a_target_without_tree_attention_verifies_the_first_child_chain(llama_target, monkeypatch):
    prompt = [1, 5, 7, 9]
    expected = hf_greedy(llama_target, prompt, 3)
    tree = FixedTree([expected[0], 0, expected[1]], [-1, -1, 0])
    decoder = SpeculativeDecoder(llama_target, tree, FixedK(2))
    decoder.verifies_trees = False
    event = next(decoder.stream(prompt, max_new_tokens=3))
    assert event.tokens == expected and event.tree_nodes == 0 and event.drafted == 2


def test_tree_capable_refuses_sliding_windows_and_other_attention(llama_target):
    assert tree_capable(llama_target)
    config = llama_target.config
    original = config._attn_implementation
    try:
        config._attn_implementation = "flash_attention_2"
        assert not tree_capable(llama_target)
    finally:
        config._attn_implementation = original


def test_sampling_tree_steps_run_through_the_decoder(llama_target):
    tree = FixedTree([3, 4, 5, 6, 7, 8], PARENTS)
    decoder = SpeculativeDecoder(llama_target, tree, FixedK(3))
    events = list(decoder.stream([1, 5, 7, 9], SamplingParams(temperature=1.0, seed=3), max_new_tokens=12))
    assert sum(len(event.tokens) for event in events) == 12
    assert events[0].tree_nodes == 6 and events[0].tree_depth == 3 and events[0].drafted == 6
    # Near the end the tree is cut to what may still be emitted: a step emits at most depth + 1 tokens.
    emitted = 0
    for event in events:
        assert event.tree_depth <= 12 - emitted - 1 and len(event.tokens) == event.accepted + 1
        emitted += len(event.tokens)


def test_a_long_prompt_reaches_a_tree_forward_in_prefill_chunks(llama_target):
    prompt = [1] + [(5 * i + 3) % 90 + 3 for i in range(40)]
    tree_ids = [10, 11, 12, 13, 14, 15]
    chunked, whole = CachedModel(llama_target, prefill_chunk=16), CachedModel(llama_target, prefill_chunk=512)
    logits = chunked.extend_tree(prompt, tree_ids, PARENTS, sequence_logits=True)
    assert chunked.forwards == 3  # 16 + 16 prompt tokens alone, then the last 9 with the tree
    assert torch.allclose(logits, whole.extend_tree(prompt, tree_ids, PARENTS, sequence_logits=True), atol=1e-5)
    chunked.keep_path([0, 3, 5])
    assert chunked.ids == prompt + [10, 13, 15] and all(layer.keys.shape[-2] == 44 for layer in chunked.cache.layers)


def test_depth_first_puts_the_first_child_chain_first_and_keeps_sibling_order():
    parents = [-1, -1, 0, 0, 1, 2, 3]  # level order: roots 0, 1; 0's children 2, 3; 1's child 4; 2's 5; 3's 6
    assert depth_first(parents) == [0, 2, 5, 3, 6, 1, 4]
    assert depth_first(parents)[:3] == first_child_chain(parents)


@pytest.mark.parametrize("path, moved", [([0, 1, 2], False), ([0, 1], False), ([3, 4], True), ([0, 1, 5], True)])
def test_a_commit_in_place_or_moved_leaves_the_cache_equal_to_a_plain_forward(llama_target, monkeypatch, path, moved):
    parents = [-1, 0, 1, -1, 3, 1]  # depth first: the first-child chain 0-1-2 in the first places
    tree_ids = [10, 11, 12, 13, 14, 15]
    prefix = [1, 5, 7, 9]
    runner = CachedModel(llama_target)
    runner.extend_tree(prefix, tree_ids, parents, sequence_logits=True)
    selects = []
    original = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: selects.append(1) or original(self, *a))
    runner.keep_path(path)
    monkeypatch.undo()
    assert bool(selects) == moved  # a branch already in place is not copied
    accepted = prefix + [tree_ids[node] for node in path]
    assert runner.ids == accepted and runner.tree_nodes == []
    logits = runner.extend(accepted + [20, 21], 2)
    assert torch.allclose(logits, full_forward_logits(llama_target, accepted + [20, 21])[-2:], atol=1e-5)
