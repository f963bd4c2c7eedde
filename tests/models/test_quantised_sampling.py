"""Speculative sampling on an int8 target follows that int8 target's own distribution exactly: the engine's
distribution test (tests/engine/test_decode_sampling.py, whose power checks show it catches planted acceptance
bugs) run on a quantised transformers model instead of a trigram table.

A tiny random Llama over 12 ids, int8 (per-token activations, row-wise attention); the draft is the float
model of another seed, so about half the draft tokens are rejected. The exact marginals of the 1st, 2nd and
3rd generated tokens come from the int8 target's one-token forwards over every path (1 + 12 + 144 forwards);
20,000 seeded speculative generations (k = 3) must fit them (chi-square and TV, tests/stats.py)."""

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, logits_to_probs
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import tiny_causal_lm
from tests.stats import fit_failure

VOCAB = 12
PROMPT = [1, 4, 7, 4, 1]
DRAWS = 20_000
PARAMS = SamplingParams(temperature=1.0)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@torch.no_grad()
def next_probs(model, ids: list[int]) -> torch.Tensor:
    """(V,) the target's distribution of the token after `ids`, from a forward of the last token alone on a
    cache of the others — how one-token decoding computes it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids[:-1]]), cache=cache)
    logits = model(input_ids=torch.tensor([ids[-1:]]), cache=cache).logits[0, -1]
    return logits_to_probs(logits, PARAMS).double()


def exact_marginals(model) -> torch.Tensor:
    """(3, V): P(the i-th generated token = v) under the target decoding alone."""
    first = next_probs(model, PROMPT)
    second = torch.zeros(VOCAB, dtype=torch.float64)
    third = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        after_a = next_probs(model, PROMPT + [a])
        second += first[a] * after_a
        for b in range(VOCAB):
            third += first[a] * after_a[b] * next_probs(model, PROMPT + [a, b])
    return torch.stack([first, second, third])


def test_speculative_sampling_on_an_int8_target_follows_that_targets_distribution():
    target = quantize(tiny_causal_lm("llama", vocab_size=VOCAB, seed=3, logit_scale=2.0), "int8")
    draft = tiny_causal_lm("llama", vocab_size=VOCAB, seed=4, logit_scale=2.0)
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(3))
    tokens = torch.empty(DRAWS, 3, dtype=torch.long)
    drafted = accepted = 0
    for seed in range(DRAWS):
        result = decoder.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed), 4, stop=lambda generated: len(generated) >= 3)
        tokens[seed] = torch.tensor(result.tokens[:3])
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0.2 < accepted / drafted < 0.9  # rejections and acceptances both happen often
    exact = exact_marginals(target)
    for position in range(3):
        counts = torch.bincount(tokens[:, position], minlength=VOCAB).double()
        assert fit_failure(counts, exact[position]) is None, f"token {position + 1}"
