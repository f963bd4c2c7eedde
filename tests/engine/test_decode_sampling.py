"""Speculative sampling through the whole engine follows the target's distribution exactly, for every
drafter and draft length the CLI can run; and the check has the power to see realistic bugs.

Tiny vocabulary (12 ids), 20,000 seeded generations per case; the empirical distribution of each of
the 1st, 2nd and 3rd generated tokens is compared with the target's exact marginals, computed by
summing over every path (tests/stats.py: chi-square and a TV ceiling derived from the sample size).
The draft is the target sharpened and perturbed: about half its tokens are accepted, so accepted
prefixes, rejections mid-draft and corrections all occur often. The models are random trigram LMs
behind the transformers interface (see tests/conftest.py): cheap enough for 20,000 generations per
case. A new drafter (token trees, say) gets its own entry in CASES."""

import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, Drafter
from specdec_cli.engine import (
    DraftLengthPolicy, DraftRule, FixedK, GenerationStats, SamplingParams, SpeculativeDecoder, logits_to_probs,
)

from tests.conftest import TrigramLM
from tests.stats import fit_failure

VOCAB = 12
PROMPT = [1, 4, 7, 4, 1, 4]  # repeats itself: the cascade's lookup finds matches
DRAWS = 20_000
POSITIONS = 3
SUBSET = torch.tensor([0, 1, 2, 4, 5, 7, 8, 10])  # the subset head drafts these ids only
ODDS_CUT = DraftRule(min_survival=0.3)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_pair() -> tuple[TrigramLM, TrigramLM]:
    """The target, and the draft: the target sharpened and perturbed."""
    target, draft = TrigramLM(VOCAB, seed=11, scale=1.5), TrigramLM(VOCAB, seed=11, scale=1.5)
    noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        draft.lm_head.weight.mul_(1.5).add_(noise)
    return target, draft


@pytest.fixture(scope="module")
def pair():
    return make_pair()


@torch.no_grad()
def exact_marginals(model: TrigramLM, params: SamplingParams) -> torch.Tensor:
    """(POSITIONS, V): P(the i-th generated token = v) under the target alone."""
    following = logits_to_probs(model.table, params).double()  # (V, V, V): P(c | a, b)
    first = following[PROMPT[-2], PROMPT[-1]]  # (V,)
    first_two = first[:, None] * following[PROMPT[-1]]  # (V, V): P(a, b)
    third = torch.einsum("ab,abc->c", first_two, following)
    return torch.stack([first, first_two.sum(0), third])


@dataclass(frozen=True)
class Case:
    drafter: Callable[[TrigramLM], Drafter]
    k: int
    params: SamplingParams = SamplingParams(temperature=1.0)
    rule: DraftRule | None = None  # the policy's stop rule, which the drafter obeys

    def policy(self) -> DraftLengthPolicy:
        return FixedK(self.k, self.rule)

    @property
    def max_new_tokens(self) -> int:
        """Room for a draft of up to 5 in the first step (the engine drafts at most the budget less one);
        a stop callback ends each generation once it holds POSITIONS tokens."""
        return max(POSITIONS, min(self.k, 5) + 1)


CASES = {
    "chain k=1": Case(DraftModelDrafter, 1),
    "chain k=3, top-k and top-p": Case(DraftModelDrafter, 3, SamplingParams(temperature=0.7, top_k=6, top_p=0.9)),
    "chain k=5": Case(DraftModelDrafter, 5),
    # The odds cut (k = auto without the clock, as `run` drafts): up to 20 tokens (here the budget caps the
    # first step at 5), stopping once the draft's own odds for its whole draft fall below 0.3.
    "odds cut": Case(DraftModelDrafter, 20, rule=ODDS_CUT),
    # The default drafter under the same rule: lookup drafts (no probabilities: the point-mass rule) when
    # the text repeats, the draft model with its odds cut otherwise.
    "cascade with the odds cut": Case(lambda draft: CascadeDrafter(DraftModelDrafter(draft)), 20, rule=ODDS_CUT),
    "subset head": Case(lambda draft: DraftModelDrafter(draft, token_ids=SUBSET), 3),
}


@dataclass
class Sampled:
    counts: torch.Tensor  # (POSITIONS, V)
    stats: GenerationStats
    drafter: Drafter


def sample_case(pair, case: Case) -> Sampled:
    """DRAWS generations, each from its own seed, on one decoder (its caches carried between them,
    as in a chat)."""
    target, draft = pair
    drafter = case.drafter(draft)
    decoder = SpeculativeDecoder(target, drafter, case.policy())
    tokens = torch.empty(DRAWS, POSITIONS, dtype=torch.long)
    stats = GenerationStats()
    p = case.params
    for seed in range(DRAWS):
        result = decoder.generate(PROMPT, SamplingParams(p.temperature, p.top_k, p.top_p, seed), case.max_new_tokens,
                                  stop=lambda generated: len(generated) >= POSITIONS)
        tokens[seed] = torch.tensor(result.tokens[:POSITIONS])
        stats.merge(result.stats)
    counts = torch.stack([torch.bincount(tokens[:, i], minlength=VOCAB) for i in range(POSITIONS)]).double()
    return Sampled(counts, stats, drafter)


def failures(pair, case: Case, sampled: Sampled) -> list[str]:
    exact = exact_marginals(pair[0], case.params)
    found = [(position, fit_failure(sampled.counts[position], exact[position])) for position in range(POSITIONS)]
    return [f"token {position + 1}: {failure}" for position, failure in found if failure]


@pytest.fixture(scope="module")
def sampled(pair):
    """Each case sampled once, on first use."""
    cache: dict[str, Sampled] = {}

    def get(name: str) -> Sampled:
        if name not in cache:
            cache[name] = sample_case(pair, CASES[name])
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_position_follows_the_target_distribution(pair, sampled, name):
    result = sampled(name)
    assert failures(pair, CASES[name], result) == []
    assert 0.1 < result.stats.acceptance_rate < 0.9  # both acceptance and rejection were exercised
    assert len(result.stats.drafted_at) >= min(CASES[name].k, POSITIONS)  # drafts reached the positions checked


@pytest.mark.slow
def test_the_cascade_used_both_sources(sampled):
    result = sampled("cascade with the odds cut")
    assert result.drafter.used_ngram > 1000 and result.drafter.used_model > 1000
    assert 0 < result.stats.lookup_accepted < result.stats.lookup_drafted


@pytest.mark.slow
def test_the_odds_cut_cut_drafts_short(sampled):
    drafted_at = sampled("odds cut").stats.drafted_at  # drafted_at[i]: steps that drafted position i+1
    assert drafted_at[3] < 0.25 * drafted_at[0]  # without the cut the budget lets most first steps draft 5
    assert drafted_at[2] > 0


@pytest.mark.slow
def test_the_target_emits_ids_the_subset_head_cannot_draft(sampled):
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[SUBSET] = False
    assert float(sampled("subset head").counts[:, outside].sum()) > 1000


# ---- power: the same check, at the same thresholds, rejects realistic bugs -------------------------


def _real_verdict():
    return sys.modules[SpeculativeDecoder.__module__].sampling_verdict


def _resample_from_the_target(real):
    """The correction after a rejection drawn from the target's row instead of the residual."""
    from specdec_cli.engine.sampling import sample

    def verdict(draft_ids, draft_probs, target_probs, generator):
        kept = real(draft_ids, draft_probs, target_probs, generator)
        if kept.is_bonus:
            return kept
        return type(kept)(kept.accepted, sample(target_probs[kept.accepted].float(), generator), False)

    return verdict


def _previous_draft_row(real):
    """Draft token i judged by (and its residual built from) draft row i-1: an off-by-one row index."""

    def verdict(draft_ids, draft_probs, target_probs, generator):
        if draft_probs is not None:
            draft_probs = draft_probs[(torch.arange(len(draft_ids)) - 1).clamp_min(0)]
        return real(draft_ids, draft_probs, target_probs, generator)

    return verdict


def _keep_the_rejected_token(real):
    """On a rejection the accepted prefix runs one token too far: the rejected draft token is kept,
    then the correction follows it."""

    def verdict(draft_ids, draft_probs, target_probs, generator):
        kept = real(draft_ids, draft_probs, target_probs, generator)
        if kept.is_bonus:
            return kept
        return type(kept)(kept.accepted + 1, kept.next_token, kept.accepted + 1 == len(draft_ids))

    return verdict


BUGS = {
    "resampling from the target instead of the residual": (_resample_from_the_target, "chain k=1"),
    "the previous draft row at k >= 2": (_previous_draft_row, "chain k=5"),
    "an off-by-one in the accepted prefix": (_keep_the_rejected_token, "chain k=1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_the_check_rejects_a_planted_bug(pair, monkeypatch, bug):
    plant, case_name = BUGS[bug]
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "sampling_verdict", plant(_real_verdict()))
    case = CASES[case_name]
    assert failures(pair, case, sample_case(pair, case)) != []


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
