"""Speculative sampling over token trees follows the target's distribution exactly, and the same test
catches a wrong residual (power check).

The harness of test_decode_sampling (20,000 seeded generations, every one of the first 3 tokens
compared with the target's exact marginals, chi-square and a TV ceiling), with the trigram LMs taught
to read a tree mask. Trees have >= 2 children per node: distinct draws from the draft, each reported with the distribution it
was drawn from (the tree drafter), and, separately, chosen deterministically (point masses)."""

from types import SimpleNamespace

import pytest
import torch

from specdec_cli.drafters import tree as tree_drafter
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import SamplingParams
from specdec_cli.engine import tree as tree_module
from specdec_cli.engine.draft import Draft, DraftRule, Drafter

from tests.conftest import TrigramLM
from tests.engine.test_decode_sampling import VOCAB, Case, failures, make_pair, sample_case

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class TreeTrigramLM(TrigramLM):
    """The trigram LM, reading a 4D tree mask: a query's previous token is the latest cache entry it
    may see before itself (its parent, or the sequence's last token for a root)."""

    def __init__(self, like: TrigramLM) -> None:
        super().__init__(VOCAB, seed=0)
        self.lm_head.weight = like.lm_head.weight
        self.config._attn_implementation = "eager"  # an additive mask, as eager attention takes it

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, attention_mask=None, **kwargs):
        new = input_ids.float()[:, None, :, None]  # (1, 1, T, 1)
        keys, _ = cache.update(new, new, 0)
        ids = keys[0, 0, :, 0].long()  # (L,) every cached entry
        length, fed = ids.shape[0], input_ids.shape[1]
        if attention_mask is None:
            seen = torch.ones(fed, length, dtype=torch.bool).tril(length - fed)
        else:
            seen = attention_mask[0, 0] == 0  # (T, L)
        own = torch.arange(length - fed, length)
        before = seen & (torch.arange(length)[None, :] < own[:, None])
        previous_at = torch.where(before.any(-1), (before * torch.arange(1, length + 1)).argmax(-1), -1)
        previous = torch.where(previous_at >= 0, ids[previous_at.clamp_min(0)], 0)
        logits = self.table[previous, ids[own]][None]  # (1, T, V)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


class TopTwoTree(Drafter):
    """Point-mass trees: the draft's top-2 tokens, and under each its top-2 (6 nodes, deterministic)."""

    name = "top-two"

    def __init__(self, model: TrigramLM) -> None:
        self.model = model

    def propose(self, ids, k, params, generator) -> Draft:
        roots = torch.topk(self.model.table[ids[-2], ids[-1]], 2).indices.tolist()
        nodes, parents = list(roots), [-1, -1]
        for index, root in enumerate(roots):
            nodes += torch.topk(self.model.table[ids[-1], root], 2).indices.tolist()
            parents += [index, index]
        return Draft(nodes, None, parents)


CASES = {
    "sampled tree, 6 nodes, 2 children": Case(lambda draft: TreeDrafter(draft, budget=6, branching=2), 2),
    # grown by value: how many children a node gets comes from the draft's odds, before any draw
    "sampled tree grown by value": Case(lambda draft: TreeDrafter(draft, budget=8, branching=3), 3,
                                        rule=DraftRule(min_survival=0.2, branch_cut=0.08)),
    "sampled tree, top-k and top-p": Case(lambda draft: TreeDrafter(draft, budget=6, branching=3), 2,
                                          SamplingParams(temperature=0.7, top_k=6, top_p=0.9)),
    "point-mass tree": Case(TopTwoTree, 2),
}


@pytest.fixture(scope="module")
def pair():
    target, draft = make_pair()
    return TreeTrigramLM(target), TreeTrigramLM(draft)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_position_follows_the_target_distribution(pair, name):
    result = sample_case(pair, CASES[name])
    assert failures(pair, CASES[name], result) == []
    assert 0 < result.stats.tree_accepted < result.stats.tree_nodes  # acceptance and rejection both ran


@pytest.mark.slow
def test_a_wrong_residual_is_caught(pair, monkeypatch):
    """Power check: keep the target's distribution after a rejection instead of subtracting the draft's."""
    monkeypatch.setattr(tree_module, "next_residual", lambda residual, draft_row: residual)
    case = CASES["point-mass tree"]
    assert failures(pair, case, sample_case(pair, case)) != []


@pytest.mark.slow
def test_siblings_reported_with_the_undivided_distribution_are_caught(pair, monkeypatch):
    """Power check: siblings drawn without replacement but each reported as drawn from the draft's whole
    distribution (the second's q without the first's id left out and renormalised) skew the output."""
    draw_distinct = tree_drafter._draw_distinct

    def undivided(probs, count, generator):
        children, _rows = draw_distinct(probs, count, generator)
        return children, [probs] * len(children)

    monkeypatch.setattr(tree_drafter, "_draw_distinct", undivided)
    case = CASES["sampled tree, 6 nodes, 2 children"]
    assert failures(pair, case, sample_case(pair, case)) != []
