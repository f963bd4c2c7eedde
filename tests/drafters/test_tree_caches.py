"""After each tree step both caches (the target's and the tree drafter's) hold exactly the accepted
sequence, as a plain forward over it would (keys, values and the next logits compared); a tree forward
interrupted in either model leaves both consistent, and decoding goes on to the target's own output."""

import pytest
import torch

from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.kv import CachedModel

from tests.conftest import hf_greedy

PROMPT = [1, 5, 7, 9, 11]


def assert_plain(runner: CachedModel, model) -> None:
    """`runner`'s cache holds its ids (then the tree entries it lists, if any), the ids' entries and the
    next logits as a plain forward over the ids gives them."""
    length = len(runner.ids)
    filled = [layer for layer in runner.cache.layers if layer.keys is not None]  # a first forward cut short fills some
    assert all(layer.keys.shape[-2] == length + len(runner.tree_nodes) for layer in filled)
    plain = CachedModel(model)
    plain.extend(runner.ids or [0], 1)
    for mine, theirs in zip(filled if length else [], plain.cache.layers):
        assert torch.allclose(mine.keys[..., :length, :], theirs.keys, atol=1e-5)
        assert torch.allclose(mine.values[..., :length, :], theirs.values, atol=1e-5)
    following = runner.ids + [20, 21]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([following])).logits[0, -2:]
    assert torch.allclose(runner.extend(following, 2), expected, atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)], ids=["greedy", "sampled"])
def test_each_step_commits_both_caches_to_the_accepted_sequence(llama_target, llama_near_draft, params):
    for steps in (1, 3):
        drafter = TreeDrafter(llama_near_draft, budget=8, branching=2)
        decoder = SpeculativeDecoder(llama_target, drafter, FixedK(4))
        stream = decoder.stream(PROMPT, params, max_new_tokens=30)
        events = [next(stream) for _ in range(steps)]
        emitted = [token for event in events for token in event.tokens]
        assert events[-1].tree_nodes > 1
        # The target holds the prompt and every accepted token; the step's last token is not fed yet.
        assert decoder.target.ids == PROMPT + emitted[:-1]
        # The draft holds the accepted path as far as it fed it (the tree's last level is never fed).
        assert (PROMPT + emitted)[: len(drafter.runner.ids)] == drafter.runner.ids
        assert len(drafter.runner.ids) >= len(PROMPT) + len(emitted) - events[-1].accepted - 1
        assert decoder.target.tree_nodes == [] and drafter.runner.tree_nodes == []
        assert_plain(decoder.target, llama_target)
        assert_plain(drafter.runner, llama_near_draft)


class Interrupt:
    """A layer forward that raises KeyboardInterrupt on its `on`-th call (Ctrl-C inside a forward)."""

    def __init__(self, layer, on: int) -> None:
        self.layer, self.forward, self.calls, self.on = layer, layer.forward, 0, on

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.on:
            raise KeyboardInterrupt
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("role, on", [("draft", 2), ("draft", 3), ("target", 1), ("target", 2)])
def test_an_interrupted_tree_forward_leaves_both_caches_consistent(llama_target, llama_near_draft, role, on,
                                                                   monkeypatch):
    drafter = TreeDrafter(llama_near_draft, budget=8, branching=2)
    decoder = SpeculativeDecoder(llama_target, drafter, FixedK(4))
    model = llama_near_draft if role == "draft" else llama_target
    interrupt = Interrupt(model.model.layers[1], on)
    monkeypatch.setattr(model.model.layers[1], "forward", interrupt)
    with pytest.raises(KeyboardInterrupt):
        decoder.generate(PROMPT, max_new_tokens=30)
    monkeypatch.undo()
    assert decoder.target.tree_nodes == []  # the target commits right after its tree forward
    assert_plain(decoder.target, llama_target)
    assert_plain(drafter.runner, llama_near_draft)
    assert decoder.generate(PROMPT, max_new_tokens=30).tokens == hf_greedy(llama_target, PROMPT, 30)
