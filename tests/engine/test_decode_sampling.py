"""Speculative sampling through the whole engine follows the target's distribution exactly.

Tiny vocabulary (12 ids), 20,000 seeded generations of 3 tokens each; the empirical distribution of
the 1st and of the 3rd generated token is compared with the target's exact probabilities, computed by
enumerating every 2-token path. The draft is a different model with sharper logits, so its
distribution is far from the target's and many drafts are rejected. The models are random trigram
LMs behind the transformers forward interface (see conftest): cheap enough for 20,000 draws."""

import itertools

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter, NgramDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, logits_to_probs

from tests.conftest import TrigramLM
from tests.stats import assert_follows, draw_counts

VOCAB = 12
PROMPT = [1, 4, 7, 4]
DRAWS = 20_000


@pytest.fixture(scope="module")
def pair():
    return TrigramLM(VOCAB, seed=11, scale=1.5), TrigramLM(VOCAB, seed=12, scale=2.5)


@torch.no_grad()
def exact_distributions(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """P(1st token) and P(3rd token) under the target alone."""
    def next_probs(ids):
        return logits_to_probs(model.table[ids[-2], ids[-1]], params).double()

    first = next_probs(PROMPT)
    third = torch.zeros(VOCAB, dtype=torch.float64)
    for a, b in itertools.product(range(VOCAB), repeat=2):
        path = first[a] * next_probs(PROMPT + [a])[b]
        if path > 0:
            third += path * next_probs(PROMPT + [a, b])
    return first, third


CASES = {
    "temperature": SamplingParams(temperature=1.0),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
}


# The n-gram drafter (no probabilities: the point-mass rule) needs one case only.
@pytest.mark.parametrize(
    "case, drafter_kind", [("temperature", "model"), ("top_k_top_p", "model"), ("temperature", "ngram")]
)
def test_tokens_follow_the_target_distribution(pair, case, drafter_kind):
    target, draft = pair
    params = CASES[case]
    drafter = DraftModelDrafter(draft) if drafter_kind == "model" else NgramDrafter(max_n=2)
    decoder = SpeculativeDecoder(target, drafter, FixedK(2))
    first_exact, third_exact = exact_distributions(target, params)
    firsts, thirds = [], []
    drafted = accepted = 0

    def one_generation() -> int:
        nonlocal drafted, accepted
        seed = len(firsts)
        result = decoder.generate(PROMPT, SamplingParams(params.temperature, params.top_k, params.top_p, seed), 3)
        firsts.append(result.tokens[0])
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
        return result.tokens[2]

    third_counts = draw_counts(one_generation, DRAWS, VOCAB)
    first_counts = torch.bincount(torch.tensor(firsts), minlength=VOCAB).double()
    assert_follows(first_counts, first_exact)
    assert_follows(third_counts, third_exact)
    assert 0.02 < accepted / drafted < 0.98  # both acceptance and rejection were exercised


def test_same_seed_gives_same_tokens(pair):
    target, draft = pair
    runs = [
        SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(3))
        .generate(PROMPT, SamplingParams(temperature=1.0, seed=42), 40).tokens
        for _ in range(2)
    ]
    other = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(3)).generate(
        PROMPT, SamplingParams(temperature=1.0, seed=43), 40).tokens
    assert runs[0] == runs[1] and runs[0] != other
