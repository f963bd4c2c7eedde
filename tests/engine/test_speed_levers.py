"""The speed levers stay lossless, and the cost-model policy chooses k as its model says."""

import pytest
import torch

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, NgramDrafter
from specdec_cli.drafters.subset_head import SubsetHeadLM, frequent_token_ids
from specdec_cli.engine import (
    CalibratedDraftOrNot, CostModelK, DraftOrNot, FixedK, SamplingParams, SpeculativeDecoder, expected_tokens,
)
from specdec_cli.engine.draft import DraftRule
from specdec_cli.engine.policy import VerifyCost

from tests.conftest import hf_greedy
from tests.tiny import tokenless_tokenizer

PROMPT = [1] + [(5 * i + 3) % 60 + 3 for i in range(40)]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def reference(llama_target):
    return hf_greedy(llama_target, PROMPT, NEW_TOKENS)


def generate(target, drafter, policy, max_new_tokens=NEW_TOKENS):
    return SpeculativeDecoder(target, drafter, policy).generate(PROMPT, SamplingParams(), max_new_tokens)


def test_subset_head_scores_only_the_subset(llama_target):
    subset = torch.tensor([0, 3, 5, 40, 95])
    head = SubsetHeadLM(llama_target, subset)
    from transformers import DynamicCache

    logits = head(torch.tensor([[1, 2, 3]]), cache=DynamicCache(config=llama_target.config), logits_to_keep=1).logits
    with torch.no_grad():
        full = llama_target(torch.tensor([[1, 2, 3]])).logits[:, -1:]
    assert torch.allclose(logits, full[..., subset], atol=1e-5)


def test_frequent_ids_keep_special_tokens():
    class Tokenizer:
        all_special_ids = [90, 2]
        added_tokens_decoder = {91: None}

    assert frequent_token_ids(Tokenizer(), 4, 96).tolist() == [0, 1, 2, 3, 90, 91]


@pytest.mark.parametrize("k", [2, 5])
def test_subset_head_draft_is_lossless(llama_target, llama_near_draft, reference, k):
    subset = torch.arange(0, 96, 2)  # half the vocabulary: the target's odd ids are never drafted
    drafter = DraftModelDrafter(llama_near_draft, token_ids=subset)
    result = generate(llama_target, drafter, FixedK(k))
    assert result.tokens == reference
    assert result.stats.accepted > 0


def test_subset_head_sampling_gives_the_subset_zero_mass_outside(llama_near_draft):
    subset = torch.arange(0, 96, 3)
    drafter = DraftModelDrafter(llama_near_draft, token_ids=subset)
    draft = drafter.propose(PROMPT, 4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.probs.shape == (4, 96)
    outside = torch.ones(96, dtype=torch.bool)
    outside[subset] = False
    assert float(draft.probs[:, outside].sum()) == 0.0
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4))
    assert all(token % 3 == 0 for token in draft.ids)


def test_confidence_cut_drafts_less_and_stays_lossless(llama_target, llama_near_draft, reference):
    full = generate(llama_target, DraftModelDrafter(llama_near_draft), FixedK(6))
    cut = generate(llama_target, DraftModelDrafter(llama_near_draft, min_confidence=0.9), FixedK(6))
    assert cut.tokens == full.tokens == reference
    assert cut.stats.drafted < full.stats.drafted


def test_survival_cut_drafts_less_and_stays_lossless(llama_target, llama_near_draft, reference):
    full = generate(llama_target, DraftModelDrafter(llama_near_draft), FixedK(6))
    cut = generate(llama_target, DraftModelDrafter(llama_near_draft, min_survival=0.5), FixedK(6))
    assert cut.tokens == full.tokens == reference
    assert cut.stats.drafted < full.stats.drafted


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_survival_cut_stops_right_after_the_token_whose_odds_cross_the_line(llama_near_draft, threshold):
    draft = DraftModelDrafter(llama_near_draft, min_survival=threshold).propose(
        PROMPT, 6, SamplingParams(), torch.Generator())
    with torch.no_grad():
        logits = llama_near_draft(torch.tensor([PROMPT + draft.ids])).logits[0, len(PROMPT) - 1:]
    confidences = torch.softmax(logits.float(), -1).max(-1).values[: len(draft)]
    survival = torch.cumprod(confidences, 0)
    assert draft.ids == logits[: len(draft)].argmax(-1).tolist()
    assert bool((survival[:-1] >= threshold).all())
    assert len(draft) == 6 or float(survival[-1]) < threshold


@pytest.mark.parametrize("threshold", [0.3, 0.6])
def test_sampled_survival_reads_the_drafts_odds_before_top_k_and_top_p(llama_near_draft, threshold):
    """Sampling draws from the nucleus, but the odds the cut multiplies are the draft's softmax at the sampling
    temperature before top-k/top-p: a top-p that leaves one token gives it probability 1, and with those odds
    the draft never stopped."""
    params = SamplingParams(temperature=0.7, top_p=0.05, top_k=5, seed=0)
    draft = DraftModelDrafter(llama_near_draft, min_survival=threshold).propose(
        PROMPT, 12, params, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = llama_near_draft(torch.tensor([PROMPT + draft.ids])).logits[0, len(PROMPT) - 1:]
    assert draft.ids == logits[: len(draft)].argmax(-1).tolist()  # a nucleus of one: its best token
    assert draft.probs.max(-1).values.tolist() == [1.0] * len(draft)  # what the acceptance rule gets: the nucleus
    odds = torch.softmax(logits.float() / 0.7, -1).max(-1).values[: len(draft)]
    survival = torch.cumprod(odds, 0)
    assert bool((survival[:-1] >= threshold).all())
    assert len(draft) < 12 and float(survival[-1]) < threshold


def test_cascade_is_lossless_and_uses_both_drafters(llama_target, llama_near_draft, reference):
    drafter = CascadeDrafter(DraftModelDrafter(llama_near_draft))
    result = generate(llama_target, drafter, FixedK(4))
    assert result.tokens == reference
    assert drafter.used_ngram > 0 and drafter.used_model > 0


def test_cost_model_policy_is_lossless(llama_target, llama_near_draft, reference):
    result = generate(llama_target, DraftModelDrafter(llama_near_draft), CostModelK())
    assert result.tokens == reference


def test_expected_tokens_formula():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0


def feed(policy, alpha_pattern, draft_seconds_per_token, verify_seconds, steps=60):
    """Simulate steps where the first `accepted(k)` of k drafts are accepted (verify_seconds: a number, or
    seconds of a verify of n tokens)."""
    for _ in range(steps):
        k = policy.next_k()
        accepted = alpha_pattern(k)
        seconds = verify_seconds(k + 1) if callable(verify_seconds) else verify_seconds
        policy.update(k, accepted, k * draft_seconds_per_token, seconds)
    return policy


def test_cost_model_drafts_long_when_everything_is_accepted_and_drafting_is_cheap():
    policy = feed(CostModelK(max_k=8), lambda k: k, 0.005, 0.1)
    assert policy.next_k() == 8


def test_cost_model_falls_back_to_plain_decoding_and_keeps_probing():
    policy = feed(CostModelK(probe_every=5, probe_k=2), lambda k: 0, 0.05, 0.1)
    ks = [policy.next_k()]
    for _ in range(10):
        k = policy.next_k()
        policy.update(k, 0, k * 0.05, 0.1)
        ks.append(policy.next_k())
    assert ks.count(0) >= 8 and 2 in ks


def test_cost_model_prefers_shorter_drafts_when_drafting_is_expensive():
    """Three drafts are always right, the fourth never: a cheap draft tries the fourth now and then, a dear one
    does not (k averaged over steps: the probes and the decayed counts make it swing by one from step to step)."""
    def mean_k(policy):
        ks = []
        for _ in range(24):
            k = policy.next_k()
            policy.update(k, min(k, 3), k * policy_cost[policy], 0.1)
            ks.append(k)
        return sum(ks) / len(ks)

    cheap = feed(CostModelK(), lambda k: min(k, 3), 0.002, 0.1)
    dear = feed(CostModelK(), lambda k: min(k, 3), 0.04, 0.1)
    policy_cost = {cheap: 0.002, dear: 0.04}
    assert 0 < mean_k(dear) < mean_k(cheap)


def test_draft_or_not_drafts_to_its_cap_while_drafting_pays_and_stops_when_it_does_not():
    paying = feed(DraftOrNot(max_k=20), lambda k: min(k, 4), 0.005, 0.1)
    assert paying.next_k() == 20
    hopeless = feed(DraftOrNot(max_k=20, probe_every=5), lambda k: 0, 0.05, 0.1)
    ks = []
    for _ in range(10):
        k = hopeless.next_k()
        hopeless.update(k, 0, k * 0.05, 0.1)
        ks.append(k)
    assert ks.count(0) >= 8 and 20 in ks  # plain decoding, with a probe now and then


def test_a_probes_catch_up_is_not_priced_as_drafting_so_the_gate_opens_again():
    """A draft model that sat out some steps first feeds them all in one forward: a probe after a closed
    stretch costs 3x a token's steady 10 ms. Priced as drafting, that kept the gate shut on a Spec-Bench coding
    answer while the draft was right 2 times in 3; the gate must open again once acceptance pays, and a
    draft token must stay priced at what it costs while drafting step after step."""
    policy = DraftOrNot(max_k=20, rule=DraftRule(min_survival=0.3), verify_curve={1: 0.03, 2: 0.03, 4: 0.03, 8: 0.03})
    drafted_before = False
    drafting = []
    for step in range(80):
        k = policy.next_k()
        drafted = min(k, 2)
        accepted = 0 if step < 4 else drafted  # a bad start shuts the gate; then every draft is right
        per_token = 0.010 if drafted_before else 0.030  # a draft after a step without one catches up first
        policy.update(drafted, accepted, drafted * per_token, 0.03)
        drafted_before = drafted > 0
        drafting.append(drafted > 0)
    assert not all(drafting[4:12])  # the bad start shut it
    assert all(drafting[-20:])  # and it opened again and stayed open
    assert policy.draft_cost.value == pytest.approx(0.010)


def test_the_odds_cut_rises_with_what_a_draft_token_costs_and_never_falls_below_the_rule():
    """The drafter holds the odds S of what it drafted so far against the cut before it pays for one more
    token, which adds S x (its chance once the others were accepted) to the step: that pays while it, times
    the expected rate, beats the draft cost plus the verify's slope. A draft at 0.3 of a target step, accepted
    2 times in 3 past its first token, cuts near 0.9; a cheap one keeps the rule's 0.3."""
    rule = DraftRule(min_survival=0.3)
    flat = {1: 0.1, 2: 0.1, 4: 0.1, 8: 0.1, 16: 0.1}
    dear = feed(DraftOrNot(rule=rule, verify_curve=flat), lambda k: min(k, 3), 0.03, 0.1)
    cheap = feed(DraftOrNot(rule=rule, verify_curve=flat), lambda k: min(k, 3), 0.002, 0.1)
    assert dear.next_k() > 0  # drafting still pays: the cut decides how far, not whether
    rate, following = dear.best_model_rate(), dear.next_acceptance()
    assert following == pytest.approx(2 / 3, abs=0.01)  # past the first position: 2 and 3 kept, 4 rejected
    assert dear.rule.min_survival == pytest.approx(0.03 * rate / following) and 0.6 < dear.rule.min_survival < 0.95
    assert cheap.rule.min_survival == 0.3  # 0.002 x rate / following is below the rule's own cut
    steep = {1: 0.1, 2: 0.12, 4: 0.16, 8: 0.24, 16: 0.4}  # +0.02 s a token past the first
    sloped = feed(DraftOrNot(rule=rule, verify_curve=steep), lambda k: min(k, 3), 0.002, VerifyCost(steep).at)
    assert sloped.rule.min_survival == pytest.approx((0.002 + 0.02) * sloped.best_model_rate() / sloped.next_acceptance())
    fixed = feed(DraftOrNot(rule=rule, verify_curve=flat, cost_cut=False), lambda k: min(k, 3), 0.04, 0.1)
    assert fixed.rule.min_survival == 0.3


def test_auto_is_draft_or_not_with_the_survival_cut_and_a_fixed_k_drafts_exactly_k(llama_target, llama_near_draft):
    from types import SimpleNamespace

    from specdec_cli.session import (AUTO_MAX_K, AUTO_SURVIVAL, DRAFT_WINDOW, build_batched_decoder, make_drafter,
                                     make_policy)

    draft = SimpleNamespace(model=llama_near_draft, tokenizer=None, vocab_size=llama_near_draft.config.vocab_size,
                            name="tiny draft", quantization=None, dtype=torch.float32, vocabulary_overlap=None)
    auto, fixed = make_drafter("cascade", draft, "auto"), make_drafter("cascade", draft, 4)
    assert auto.model_drafter.min_survival == AUTO_SURVIVAL and fixed.model_drafter.min_survival == 0.0
    assert auto.model_drafter.window.size == make_drafter("model", draft, "auto").window.size == DRAFT_WINDOW
    target = SimpleNamespace(model=llama_target, tokenizer=tokenless_tokenizer(), eos_token_ids=(),
                             name="tiny", quantization=None, dtype=torch.float32)
    batched = build_batched_decoder(target, draft, "cascade", "auto", 4)
    assert batched.draft_window == DRAFT_WINDOW  # run's batches read the window as chat's drafter does
    assert build_batched_decoder(target, draft, "tree", "auto", 4).drafter == "cascade"  # a tree's lookups, then chains
    assert isinstance(make_policy("auto"), DraftOrNot) and make_policy("auto").next_k() > 0
    assert make_policy("auto").max_k == AUTO_MAX_K and make_policy(4).next_k() == 4
    clock_free = make_policy("auto", clock_free=True)  # run's: never reads the clock
    assert isinstance(clock_free, FixedK) and clock_free.next_k() == AUTO_MAX_K


CURVE = {1: 0.030, 2: 0.031, 4: 0.034, 8: 0.060, 16: 0.120}  # a q4 target's shape (seconds per forward of n)


def test_run_one_at_a_time_prices_drafts_with_the_calibration_and_never_the_clock():
    from specdec_cli.session import AUTO_MAX_K, make_policy

    cheap = make_policy("auto", clock_free=True, verify_curve=CURVE, draft_curve={1: 0.006})
    twin = make_policy("auto", clock_free=True, verify_curve=CURVE, draft_curve={1: 0.006})
    assert isinstance(cheap, CalibratedDraftOrNot)
    for drafted, accepted, free in [(3, 3, False), (4, 1, False), (0, 0, False), (5, 5, True), (2, 0, False)] * 4:
        cheap.update(drafted, accepted, 0.001, 9.0, free)  # whatever the clock said
        twin.update(drafted, accepted, None, None, free)
        assert (cheap.next_k(), cheap.rule, cheap.lookup_k) == (twin.next_k(), twin.rule, twin.lookup_k)
    for _ in range(4):
        cheap.update(4, 4, None, None)
    assert cheap.next_k() == AUTO_MAX_K and cheap.rule.min_survival > 0  # drafting pays: the odds cut says how far
    dear = make_policy("auto", clock_free=True, verify_curve=CURVE, draft_curve={1: 0.2})  # a draft dearer than a verify
    ks = []
    for _ in range(16):
        dear.update(3, 1, None, None)
        ks.append(dear.next_k())
    assert ks.count(0) >= 12  # plain decoding but for its probes
    assert isinstance(make_policy("auto", clock_free=True, verify_curve=CURVE), FixedK)  # no draft cost measured


def test_draft_or_not_with_the_survival_cut_is_lossless(llama_target, llama_near_draft, reference):
    """On calibrated costs (not the clock) that make drafting pay, DraftOrNot lets the draft model go up to
    AUTO_MAX_K: the survival cut stops every draft short of it, and the tokens are the target's own."""
    from specdec_cli.session import AUTO_MAX_K

    drafter = CascadeDrafter(DraftModelDrafter(llama_near_draft, min_survival=0.3))
    result = generate(llama_target, drafter, CalibratedDraftOrNot(0.006, CURVE, max_k=AUTO_MAX_K))
    assert result.tokens == reference
    assert result.stats.drafted > result.stats.lookup_drafted  # the draft model drafted, not only lookups
    assert 0 < len(result.stats.drafted_at) < AUTO_MAX_K  # the cut stopped every draft before max_k


def test_cascade_looks_up_even_when_the_policy_says_no_draft(llama_target, llama_near_draft, reference):
    drafter = CascadeDrafter(DraftModelDrafter(llama_near_draft), lookup_k=6)
    result = generate(llama_target, drafter, FixedK(0))
    assert result.tokens == reference
    assert drafter.used_ngram > 0 and result.stats.drafted > 0
    assert max(result.stats.drafted_at and range(len(result.stats.drafted_at))) + 1 <= 6


def test_lookup_steps_reach_the_policy_marked_free(llama_target, reference):
    """Every step reaches the policy; a lookup's as free (it cost nothing to draft, its verify did cost)."""

    class Recording(FixedK):
        def update(self, drafted, accepted, draft_seconds, verify_seconds, free=False):
            self.seen.append((drafted, free))

    policy = Recording(4)
    policy.seen = []
    events = list(SpeculativeDecoder(llama_target, NgramDrafter(), policy).stream(PROMPT, SamplingParams(), NEW_TOKENS))
    assert [token for event in events for token in event.tokens] == reference
    assert policy.seen == [(event.drafted, event.free) for event in events]
    assert any(free for _, free in policy.seen) and any(not free for _, free in policy.seen)


def feed_lookups(policy, accepted_of, verify_seconds_of, steps=80):
    """Simulate lookup steps (free drafts of the policy's lookup length) and plain steps between them."""
    for step in range(steps):
        k = policy.rule.lookup_k
        if k and step % 2 == 0:
            policy.update(k, accepted_of(k), 0.0, verify_seconds_of(k + 1), free=True)
        else:
            policy.update(0, 0, 0.0, verify_seconds_of(1))
    return policy


def test_lookups_that_are_rejected_stop_when_verifying_them_costs_more_than_they_return():
    rule = DraftRule(lookup_k=8)
    rising = lambda n: 0.1 * (1 + 0.25 * (n - 1))  # a verify of n tokens: +25% per token (not flat)
    hopeless = feed_lookups(DraftOrNot(rule=rule), lambda k: 0, rising)
    assert hopeless.rule.lookup_k == 0 or hopeless.steps_since_lookup_probe == 0  # off, but for its probes
    assert hopeless.lookup_tokens_per_second(4) < hopeless.best_model_rate()


def test_lookups_that_are_accepted_stay_long_on_a_flat_verify():
    flat = lambda n: 0.1
    paying = feed_lookups(DraftOrNot(rule=DraftRule(lookup_k=8)), lambda k: k, flat)
    assert paying.rule.lookup_k == paying.max_lookup


def test_a_calibrated_curve_decides_the_lookup_length_where_half_the_lookups_fail():
    """Acceptance 1, 1, 0.5, 0.5...: on a flat verify a long lookup pays; where each extra token costs a
    whole forward, the lookup length shrinks (and the run's timings only scale the curve)."""
    accepted = lambda k: min(k, 2)
    flat_curve = {1: 0.1, 2: 0.1, 4: 0.1, 8: 0.11, 16: 0.12}
    steep_curve = {1: 0.1, 2: 0.2, 4: 0.4, 8: 0.8, 16: 1.6}
    flat = feed_lookups(DraftOrNot(rule=DraftRule(lookup_k=8), verify_curve=flat_curve), accepted,
                        lambda n: 2 * VerifyCost(flat_curve).at(n))
    steep = feed_lookups(DraftOrNot(rule=DraftRule(lookup_k=8), verify_curve=steep_curve), accepted,
                         lambda n: 2 * VerifyCost(steep_curve).at(n))
    assert steep.rule.lookup_k in (0, 1, 2) and flat.rule.lookup_k > 2
    assert flat.verify.at(1) == pytest.approx(0.2)  # the curve, scaled by the run's timings (twice it)


def test_verify_cost_follows_the_curve_between_and_past_its_points():
    cost = VerifyCost({1: 0.1, 4: 0.1, 8: 0.2})
    assert cost.at(2) == pytest.approx(0.1) and cost.at(6) == pytest.approx(0.15)
    assert cost.at(16) == pytest.approx(0.4)  # the last segment's slope
    learned = VerifyCost()
    for n, seconds in [(1, 0.1), (5, 0.3), (1, 0.1), (5, 0.3)]:
        learned.add(n, seconds, 1.0)
    assert learned.at(3) == pytest.approx(0.2)


def test_verify_cost_takes_a_dip_in_the_curve_as_noise():
    """A calibration on a drifting machine can time 2 tokens below 1; the cost model must not believe that
    verifying a draft costs less than decoding without one."""
    cost = VerifyCost({1: 0.037, 2: 0.030, 4: 0.046, 8: 0.044, 16: 0.105})
    assert cost.at(1) == cost.at(2) == pytest.approx(0.037)
    assert cost.at(8) == pytest.approx(0.046) and cost.at(16) == pytest.approx(0.105)
    assert all(cost.at(n) <= cost.at(n + 1) for n in range(1, 20))


def test_the_decoder_hands_the_drafter_the_lookup_length_the_policy_chose(llama_target, reference):
    class Chooser:  # a fixed k of 4, with a lookup length set from outside
        lookup_k = 0
        next_k, update, reset = (lambda self: 4), (lambda self, *args, **kwargs: None), (lambda self: None)

        @property
        def rule(self):
            return DraftRule(lookup_k=self.lookup_k)

    policy = Chooser()
    drafter = NgramDrafter()
    decoder = SpeculativeDecoder(llama_target, drafter, policy)
    assert decoder.generate(PROMPT, SamplingParams(), NEW_TOKENS).stats.drafted == 0  # lookups off
    policy.lookup_k = 2
    result = decoder.generate(PROMPT, SamplingParams(), NEW_TOKENS)
    assert result.tokens == reference and result.stats.drafted > 0 and drafter.lookup_k == 2
    assert len(result.stats.drafted_at) <= 2


def test_cost_model_learns_that_acceptance_rises_with_depth():
    """Bursty acceptance: half the drafts fail at once, the other half are right to the end."""
    import random

    coin, policy = random.Random(0), CostModelK()
    for _ in range(200):
        k = policy.next_k()
        policy.update(k, k if coin.random() < 0.5 else 0, k * 0.03, 0.1)
    rates = policy.acceptance_by_position()
    assert rates[0] < 0.6 and min(rates[1:4]) > 0.9
    assert policy.next_k() >= 4  # an i.i.d. rate of ~0.5 would stop at 1 or 2


def test_a_large_vocabulary_draft_scores_its_frequent_ids_by_default_and_stays_lossless():
    """make_drafter gives a draft of more than 1.5 x DRAFT_VOCAB ids a subset head (built once per model),
    a small vocabulary keeps the full head; the output stays the target's."""
    from types import SimpleNamespace

    from specdec_cli.drafters.subset_head import DRAFT_VOCAB, draft_vocabulary
    from specdec_cli.session import make_drafter

    from tests.conftest import tiny_causal_lm

    vocab = DRAFT_VOCAB * 2
    target = tiny_causal_lm("llama", vocab_size=vocab, hidden=16, logit_scale=4.0)
    draft_model = tiny_causal_lm("llama", vocab_size=vocab, hidden=16, logit_scale=4.0)  # same seed: it agrees
    draft = SimpleNamespace(model=draft_model, tokenizer=None, vocab_size=vocab, vocabulary_overlap=None)
    first, second = make_drafter("cascade", draft, "auto"), make_drafter("model", draft, "auto")
    assert len(first.model_drafter.subset) == DRAFT_VOCAB and first.model_drafter.head is second.head
    assert draft_vocabulary(None, DRAFT_VOCAB * 3 // 2) is None
    prompt = [1] + [(7 * i + 3) % 500 + 3 for i in range(30)]
    reference = hf_greedy(target, prompt, 24)
    result = SpeculativeDecoder(target, first, DraftOrNot(rule=DraftRule(0.3))).generate(
        prompt, SamplingParams(), 24)
    assert result.tokens == reference and result.stats.accepted > 0
