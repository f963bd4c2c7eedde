"""Speculative sampling over token trees follows the target's distribution exactly, and the same test
catches a wrong residual (power check).

As in test_decode_sampling: 20,000 seeded generations of 3 tokens from random trigram LMs, the 1st and
3rd tokens compared with the target's exact probabilities. Trees have >= 2 children per node: sampled
i.i.d. from the draft (the tree drafter) and, separately, chosen deterministically (point masses)."""

import pytest
import torch

from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine import tree as tree_module
from specdec_cli.engine.draft import Draft, Drafter

from tests.conftest import TrigramLM
from tests.engine.test_decode_sampling import CASES, PROMPT, VOCAB, exact_distributions
from tests.stats import assert_follows, draw_counts

DRAWS = 20_000


class TreeTrigramLM(TrigramLM):
    """The trigram LM, reading a 4D tree mask: a query's previous token is the latest cache entry it
    may see before itself (its parent, or the sequence's last token for a root)."""

    def __init__(self, vocab_size: int, seed: int, scale: float = 1.0) -> None:
        super().__init__(vocab_size, seed, scale)
        self.config._attn_implementation = "eager"

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, attention_mask=None, **kwargs):
        from types import SimpleNamespace

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


@pytest.fixture(scope="module")
def pair():
    return TreeTrigramLM(VOCAB, seed=11, scale=1.5), TreeTrigramLM(VOCAB, seed=12, scale=2.5)


def sample_tokens(decoder: SpeculativeDecoder, params: SamplingParams, target) -> None:
    """Draw DRAWS generations; assert the 1st and 3rd tokens follow the target's exact distributions."""
    first_exact, third_exact = exact_distributions(target, params)
    firsts: list[int] = []
    accepted = nodes = 0

    def one_generation() -> int:
        nonlocal accepted, nodes
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, seed=len(firsts))
        result = decoder.generate(PROMPT, seeded, 3)
        firsts.append(result.tokens[0])
        accepted, nodes = accepted + result.stats.tree_accepted, nodes + result.stats.tree_nodes
        return result.tokens[2]

    third_counts = draw_counts(one_generation, DRAWS, VOCAB)
    first_counts = torch.bincount(torch.tensor(firsts), minlength=VOCAB).double()
    assert 0 < accepted < nodes  # both acceptance and rejection were exercised
    assert_follows(first_counts, first_exact)
    assert_follows(third_counts, third_exact)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["temperature", "top_k_top_p"])
def test_sampled_trees_follow_the_target_distribution(pair, case):
    target, draft = pair
    sample_tokens(SpeculativeDecoder(target, TreeDrafter(draft, budget=6, branching=2), FixedK(2)), CASES[case], target)


@pytest.mark.slow
def test_point_mass_trees_follow_the_target_distribution(pair):
    target, draft = pair
    sample_tokens(SpeculativeDecoder(target, TopTwoTree(draft), FixedK(2)), CASES["temperature"], target)


@pytest.mark.slow
def test_a_wrong_residual_is_caught(pair, monkeypatch):
    """Power check: keep the target's distribution after a rejection instead of subtracting the draft's."""
    target, draft = pair
    monkeypatch.setattr(tree_module, "next_residual", lambda residual, draft_row: residual)
    with pytest.raises(AssertionError, match="p="):
        sample_tokens(SpeculativeDecoder(target, TopTwoTree(draft), FixedK(2)), CASES["temperature"], target)
