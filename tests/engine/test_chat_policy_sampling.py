"""Speculative sampling under chat's own draft-length policy follows the target's distribution exactly: `--k auto`
as chat builds it (session.make_policy: DraftOrNot, the cost model deciding from the clock whether to draft at all,
and the cost cut on the draft model's odds), the cascade drafter, one decoder carried from generation to generation
as a chat carries it.

The clock is replaced by a deterministic one: it advances only when the drafter drafts (per drafted model token; a
lookup costs nothing) and when the target verifies (per verified token), at prices that switch every 250 generations
between a cheap draft (drafting pays: the policy drafts up to 20, cut by the odds) and a dear one (it does not: the
target alone, with a probe every 8th step and lookups still free). So the sample does not depend on the machine, and
the policy turns drafting off and on again hundreds of times.

The pair, prompt and exact marginals are tests/engine/test_decode_sampling.py's (random trigram LMs over 12 ids);
20,000 seeded generations, 1st to 3rd token, chi-square and TV (tests/stats.py). The check's power: a verify
with the draft's and the target's probabilities the other way round, on the steps where drafting resumes (the first
model draft after a step without one), fails it."""

import sys
from types import SimpleNamespace

import pytest
import torch

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter
from specdec_cli.engine import SamplingParams, SpeculativeDecoder
from specdec_cli.engine.policy import DraftOrNot
from specdec_cli.session import make_policy

from tests.engine.test_decode_sampling import DRAWS, POSITIONS, PROMPT, VOCAB, exact_marginals, make_pair
from tests.stats import fit_failure

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PARAMS = SamplingParams(temperature=1.0)
REGIME = 250  # generations per price regime
PRICES = {"cheap": (0.002, 0.030, 0.001), "dear": (0.200, 0.030, 0.001)}  # draft token, verify, verify per extra token


class Clock:
    """time.perf_counter for the decoder: seconds that pass only in drafting and verifying, at the regime's prices."""

    def __init__(self) -> None:
        self.now, self.regime = 0.0, "cheap"

    def perf_counter(self) -> float:
        return self.now

    def draft(self, draft) -> None:
        self.now += 0.0 if draft.free else PRICES[self.regime][0] * len(draft)

    def verify(self, fed: int) -> None:
        _, base, extra = PRICES[self.regime]
        self.now += base + extra * (fed - 1)


def sample(pair, monkeypatch) -> SimpleNamespace:
    target, draft = pair
    clock = Clock()
    monkeypatch.setattr(sys.modules[SpeculativeDecoder.__module__], "time", clock)
    policy = make_policy("auto")  # chat's, on a machine without a calibration
    assert isinstance(policy, DraftOrNot)
    drafter = CascadeDrafter(DraftModelDrafter(draft))
    decoder = SpeculativeDecoder(target, drafter, policy)
    propose, verify = drafter.propose, decoder._verify
    ks = []

    def timed_propose(ids, k, params, generator):
        ks.append(k)
        proposed = propose(ids, k, params, generator)
        clock.draft(proposed)
        return proposed

    def timed_verify(ids, draft, params, generator):
        clock.verify(len(draft) + 1)
        return verify(ids, draft, params, generator)

    drafter.propose, decoder._verify = timed_propose, timed_verify
    tokens = torch.empty(DRAWS, POSITIONS, dtype=torch.long)
    for seed in range(DRAWS):
        clock.regime = "dear" if (seed // REGIME) % 2 else "cheap"
        result = decoder.generate(PROMPT, SamplingParams(PARAMS.temperature, seed=seed), POSITIONS + 20,
                                  stop=lambda generated: len(generated) >= POSITIONS)
        tokens[seed] = torch.tensor(result.tokens[:POSITIONS])
    counts = torch.stack([torch.bincount(tokens[:, i], minlength=VOCAB) for i in range(POSITIONS)]).double()
    return SimpleNamespace(counts=counts, ks=ks, drafter=drafter)


def failures(pair, counts) -> list[str]:
    exact = exact_marginals(pair[0], PARAMS)
    found = [(i, fit_failure(counts[i], exact[i])) for i in range(POSITIONS)]
    return [f"token {i + 1}: {failure}" for i, failure in found if failure]


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def test_chats_clock_driven_policy_keeps_the_target_distribution(pair, monkeypatch):
    sampled = sample(pair, monkeypatch)
    assert failures(pair, sampled.counts) == []
    ks = torch.tensor(sampled.ks)
    assert int((ks == 0).sum()) > 2000 and int((ks > 1).sum()) > 2000  # the policy turned drafting off and on
    assert int(((ks[1:] > 0) & (ks[:-1] == 0)).sum()) > 500  # ... many times
    assert sampled.drafter.used_model > 1000 and sampled.drafter.used_ngram > 1000


def _probabilities_swapped(real):
    """The draft's and the target's probabilities the other way round (accepting with min(1, q/p), the residual
    built from max(0, q - p)): gpt-fast's p/q naming turned into a bug."""

    def verdict(draft_ids, draft_probs, target_probs, generator):
        k = len(draft_ids)
        as_target = torch.cat([draft_probs.to(target_probs.dtype), target_probs[k:]])
        return real(draft_ids, target_probs[:k].to(draft_probs.dtype), as_target, generator)

    return verdict


def test_the_check_rejects_swapped_probabilities_where_drafting_resumes(pair, monkeypatch):
    """Planted only on the steps where the policy resumes drafting with the model (the first model draft after a
    step without one): about a tenth of the verifies."""
    decode = sys.modules[SpeculativeDecoder.__module__]
    real, wrong = decode.sampling_verdict, _probabilities_swapped(decode.sampling_verdict)
    last_step = {"model_draft": True}
    update = DraftOrNot.update

    def remembering(self, drafted, accepted, draft_seconds, verify_seconds, free=False):
        last_step["model_draft"] = bool(drafted) and not free
        return update(self, drafted, accepted, draft_seconds, verify_seconds, free)

    def resumed_wrongly(draft_ids, draft_probs, target_probs, generator):
        if draft_probs is not None and len(draft_ids) and not last_step["model_draft"]:
            return wrong(draft_ids, draft_probs, target_probs, generator)
        return real(draft_ids, draft_probs, target_probs, generator)

    monkeypatch.setattr(DraftOrNot, "update", remembering)
    monkeypatch.setattr(decode, "sampling_verdict", resumed_wrongly)
    assert failures(pair, sample(pair, monkeypatch).counts) != []
