"""Speculative sampling on a q4 target (the format `auto` picks for the demo pair on an AVX512 CPU) with a q4 draft
follows that q4 target's own distribution exactly: the engine's distribution test (tests/engine/test_decode_sampling.py)
run on q4 models, as tests/models/test_quantised_sampling.py runs it on int8.

A tiny random Llama over 12 ids, q4 (4-bit weights, int8 activations, row-wise attention); the draft is a q4 model of
another seed, so about a quarter of the draft tokens are rejected. The exact marginals of the 1st, 2nd and 3rd generated
tokens come from the q4 target's one-token forwards over every path; 20,000 seeded speculative generations (k = 3)
must fit them (chi-square and TV, tests/stats.py). The check's power: the same run with the correction after a
rejection drawn from the target's row instead of the residual fails it."""

import sys

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import tiny_causal_lm
from tests.engine.test_decode_sampling import _resample_from_the_target
from tests.models.test_quantised_sampling import DRAWS, PROMPT, VOCAB, exact_marginals
from tests.stats import fit_failure

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def q4_pair():
    target = quantize(tiny_causal_lm("llama", vocab_size=VOCAB, seed=3, logit_scale=2.0), "q4")
    draft = quantize(tiny_causal_lm("llama", vocab_size=VOCAB, seed=4, logit_scale=2.0), "q4")
    return target, draft


@pytest.fixture(scope="module")
def exact(q4_pair):
    return exact_marginals(q4_pair[0])


def sample(q4_pair) -> tuple[torch.Tensor, float]:
    """(DRAWS, 3) the first three tokens of DRAWS seeded generations, and the acceptance rate."""
    target, draft = q4_pair
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(3))
    tokens = torch.empty(DRAWS, 3, dtype=torch.long)
    drafted = accepted = 0
    for seed in range(DRAWS):
        result = decoder.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed), 4,
                                  stop=lambda generated: len(generated) >= 3)
        tokens[seed] = torch.tensor(result.tokens[:3])
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    return tokens, accepted / drafted


def failures(tokens: torch.Tensor, exact: torch.Tensor) -> list[str]:
    found = [(i, fit_failure(torch.bincount(tokens[:, i], minlength=VOCAB).double(), exact[i])) for i in range(3)]
    return [f"token {i + 1}: {failure}" for i, failure in found if failure]


def test_speculative_sampling_on_a_q4_target_follows_that_targets_distribution(q4_pair, exact):
    tokens, acceptance = sample(q4_pair)
    assert 0.2 < acceptance < 0.9  # rejections and acceptances both happen often
    assert failures(tokens, exact) == []


def test_the_check_rejects_resampling_from_the_target_on_q4(q4_pair, exact, monkeypatch):
    decode = sys.modules[SpeculativeDecoder.__module__]
    monkeypatch.setattr(decode, "sampling_verdict", _resample_from_the_target(decode.sampling_verdict))
    tokens, _ = sample(q4_pair)
    assert failures(tokens, exact) != []
