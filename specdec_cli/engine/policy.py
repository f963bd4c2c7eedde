"""Draft-length policies: how far to draft in the next step.

A policy sees each step's outcome (drafted, accepted, and the seconds spent drafting and verifying)
and answers `next_k()`. k = 0 means plain target decoding for that step. Its `rule` (a `DraftRule`, or
None to leave the drafter as it was built) says how far a drafter goes within k: the decoder hands it
to the drafter (`Drafter.obey`), so the policy is the one owner of "how far to draft"."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from specdec_cli.engine.costs import VerifyCost, _Mean, _Positions
from specdec_cli.engine.draft import DraftRule


class DraftLengthPolicy(Protocol):
    rule: DraftRule | None
    reason: str | None  # why the next step drafts nothing although it could (drafting measured slower), else None

    def next_k(self) -> int: ...

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None,
               free: bool = False) -> None:
        """Seconds are None for a step whose timing is not representative (it prefilled a prompt); `free`:
        the draft was a lookup's (it cost nothing to draft, its verify still cost what it did)."""

    def reset(self) -> None: ...


@dataclass
class FixedK:
    k: int
    rule: DraftRule | None = None
    reason: str | None = None

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None,
               free: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class AdaptiveK:
    """Grow after a fully accepted step, shrink after a rejection, within [min_k, max_k]
    (the heuristic of HF's assisted generation, with its +2 / -1 steps)."""

    start: int = 4
    min_k: int = 1
    max_k: int = 12
    grow: int = 2
    shrink: int = 1
    rule: DraftRule | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None,
               free: bool = False) -> None:
        if drafted == 0 or free:  # lookups are not this heuristic's to judge
            return
        if accepted == drafted:
            self.k = min(self.max_k, self.k + self.grow)
        else:
            self.k = max(self.min_k, self.k - self.shrink)

    def reset(self) -> None:
        self.k = self.start


def expected_tokens(alpha: float, gamma: float) -> float:
    """Expected tokens per step when each draft token is accepted with probability alpha, until the
    first rejection, plus the target's own token: (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class CostModelK:
    """Choose k to maximise expected tokens per second from what this sequence has shown so far.

    - acceptance by draft position: a_i = P(draft token i accepted | tokens 1..i-1 accepted), from
      decayed counts with a prior. Acceptance is bursty — a draft that got the first tokens right
      tends to get the next ones right too — so a_i usually rises with i, and a single i.i.d. rate
      would choose drafts that are too short. Positions never tried take the deepest known rate.
      Expected tokens for k: 1 + sum_{i<=k} prod_{j<=i} a_j.
    - cost of one draft token from measured seconds, decayed likewise; the cost of verifying k drafts
      is a target forward of k + 1 tokens (`VerifyCost`: this machine's calibrated curve when there is
      one, scaled by the run's own timings; else a line through the run's timings).
    k = 0 (plain decoding) wins when drafting does not pay. Every `probe_every`-th step drafts two
    tokens past the best k (at least `probe_k`), so deeper positions stay measured and drafting
    resumes when the text becomes predictable again.

    A draft token's cost is what it costs while the draft model drafts step after step: a model draft
    right after a step without one (a probe, or a draft after a lookup) also feeds the draft model every
    token it skipped in one forward, and counting that catch-up as drafting made each probe look several times
    dearer than drafting is, which kept the gate shut while the draft's acceptance rose. Such a step's
    seconds count only while no step of steady drafting has been seen, and the step after it drafts too, so
    that one is.

    Lookup drafts (free: `update(..., free=True)`) are priced too: they cost nothing to draft but a
    verify of n tokens costs what the curve says. Their acceptance by position is kept apart, and the
    rule's `lookup_k` becomes the lookup length with the best expected tokens per second — 0 (no
    lookups) when that is below what drafting with the model, or plain decoding, gives; a lookup is
    still tried every `probe_every`-th step so that it comes back when the text starts repeating."""

    def __init__(self, max_k: int = 10, prior_alpha: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, probe_every: int = 8, probe_k: int = 3, rule: DraftRule | None = None,
                 verify_curve: dict[int, float] | None = None, max_lookup: int = 12) -> None:
        self.base_rule = rule
        self.max_k, self.prior_alpha, self.prior_weight = max_k, prior_alpha, prior_weight
        self.decay, self.probe_every, self.probe_k = decay, probe_every, probe_k
        self.verify_curve, self.max_lookup = verify_curve, max_lookup
        self.reset()

    def reset(self) -> None:
        self.model = _Positions(self.max_k, self.prior_alpha, self.prior_weight)
        self.lookups = _Positions(self.max_lookup, self.prior_alpha, self.prior_weight)
        self.steady_cost = _Mean()    # seconds per drafted token, while the model drafts step after step
        self.catch_up_cost = _Mean()  # ... on model drafts right after a step without one (catch-up included)
        self.drafted_last_step = False  # the last step drafted with the model (its cache is up to date)
        self.verify = VerifyCost(self.verify_curve)
        self.steps_since_probe = self.steps_since_lookup_probe = 0
        self.k = self.probe_k
        self.lookup_k = self.base_rule.lookup_k if self.base_rule is not None else self.max_lookup
        self.reason: str | None = None

    @property
    def rule(self) -> DraftRule | None:
        """The base rule with the lookup length this policy chose (None: leave the drafter as built)."""
        return None if self.base_rule is None else replace(self.base_rule, lookup_k=self.lookup_k)

    @property
    def draft_cost(self) -> "_Mean":
        """Seconds per drafted token: drafting step after step once seen, until then what the drafts with a
        catch-up cost."""
        return self.steady_cost if self.steady_cost.known else self.catch_up_cost

    def acceptance_by_position(self) -> list[float]:
        return self.model.rates()

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None,
               free: bool = False) -> None:
        model_draft = bool(drafted) and not free
        if drafted:
            (self.lookups if free else self.model).add(drafted, accepted, self.decay)
        if model_draft and draft_seconds is not None:
            cost = self.steady_cost if self.drafted_last_step else self.catch_up_cost
            cost.add(draft_seconds / drafted, self.decay)
        self.drafted_last_step = model_draft
        if verify_seconds is not None:
            self.verify.add(drafted + 1, verify_seconds, self.decay)
        self.k = self._choose()
        self.lookup_k = self._choose_lookup()

    def _choose(self) -> int:
        if not self.draft_cost.known or not self.verify.known:
            return self.probe_k
        if not self.steady_cost.known and self.drafted_last_step:
            return self.probe_k  # drafting once more measures what a token costs without a catch-up
        best = max(range(self.max_k + 1), key=self.tokens_per_second)
        self.reason = None if best else self._why_not()
        self.steps_since_probe += 1
        if self.steps_since_probe >= self.probe_every:
            # Explore: positions past the chosen k are otherwise never measured again.
            self.steps_since_probe = 0
            self.reason = None
            return min(self.max_k, max(best + 2, self.probe_k))
        return best

    def _why_not(self) -> str:
        """The measured costs that keep the next step from drafting."""
        drafting = max(self.tokens_per_second(k) for k in range(1, self.max_k + 1))
        return (f"drafting did not pay: {drafting:.1f} vs {self.tokens_per_second(0):.1f} tok/s expected "
                "from the measured costs")

    def _choose_lookup(self) -> int:
        if not self.verify.known:
            return self.lookup_k
        best = max(range(1, self.max_lookup + 1), key=self.lookup_tokens_per_second)
        if self.lookup_tokens_per_second(best) > self.best_model_rate():
            return best
        self.steps_since_lookup_probe += 1
        if self.steps_since_lookup_probe >= self.probe_every:
            self.steps_since_lookup_probe = 0
            return best
        return 0

    def expected_tokens(self, k: int) -> float:
        return self.model.expected_tokens(k)

    def tokens_per_second(self, k: int) -> float:
        seconds = (k * self.draft_cost.value if k else 0.0) + self.verify.at(k + 1)
        return self.expected_tokens(k) / max(seconds, 1e-9)

    def lookup_tokens_per_second(self, k: int) -> float:
        return self.lookups.expected_tokens(k) / max(self.verify.at(k + 1), 1e-9)

    def best_model_rate(self) -> float:
        """Tokens per second of the best model draft length (plain decoding while drafting costs are unknown)."""
        if not self.draft_cost.known:
            return self.tokens_per_second(0) if self.verify.known else 0.0
        return max(self.tokens_per_second(k) for k in range(self.max_k + 1))


CUT_SPAN = 8  # the verify slope of the odds cut: over verifies of 1 to 1 + CUT_SPAN tokens, where drafts end
FEED_SPAN = 4  # a tree level's draft forward: the draft's slope over forwards of 1 to 1 + FEED_SPAN rows


class DraftOrNot(CostModelK):
    """The cost model's yes or no: draft up to `max_k` when some k > 0 pays — the policy's `rule` (the
    draft model's odds cut) then stops the draft where the draft's own per-token odds say — else decode
    with the target alone (probing as CostModelK does). Per-token odds know more than per-position
    averages, so this leaves "how far" to them and keeps only "whether".

    The odds cut follows the measured costs (`cost_cut`). The drafter compares the survival odds S of the
    tokens it has drafted so far with the cut, to decide whether to pay for one more: that token adds
    S · a to the tokens expected from the step (a: the chance it is accepted once the ones before it were,
    which is not known before its forward) and costs a draft token plus what one more token adds to the
    verify. It pays while S · a · rate > draft + verify slope, rate being the best tokens per second the
    cost model expects (the slope taken over the first CUT_SPAN drafts), so the cut is
    (draft + slope) · rate / a, with a the model's acceptance past the first position (`next_acceptance`);
    never below the rule's own: with a draft costing 0.4 of a target step the fixed 0.3
    drafts chains that cost more than they return.

    A tree (the rule has a branch cut) gets two more cuts. A further child costs no draft forward, only its place
    in the verify: the branch cut is the verify slope times the rate. A level's nodes past its most probable one
    ride in the draft forward that node pays for: one more row of it costs the draft's slope (its calibrated
    curve's, `draft_curve`, scaled to the measured draft token; without one, the verify curve's relative slope)
    and its child's place in the verify, so the feed cut is (draft slope + verify slope) · rate / a."""

    def __init__(self, max_k: int = 20, cost_cut: bool = True, draft_curve: dict[int, float] | None = None,
                 **kwargs) -> None:
        self.cost_cut = cost_cut
        self.draft_shape = VerifyCost(draft_curve) if draft_curve else None  # its shape only, never scaled
        super().__init__(max_k=max_k, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.cut = 0.0
        self.branch_cut: float | None = None
        self.feed_cut: float | None = None

    @property
    def rule(self) -> DraftRule | None:
        rule = super().rule
        if rule is None:
            return rule
        if rule.branch_cut is not None and self.branch_cut is not None:
            rule = replace(rule, branch_cut=self.branch_cut)
        if self.cut > rule.min_survival:
            rule = replace(rule, min_survival=self.cut)
        if rule.branch_cut is not None and self.feed_cut is not None:
            rule = replace(rule, feed_cut=min(self.feed_cut, rule.min_survival))
        return rule

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None,
               free: bool = False) -> None:
        super().update(drafted, accepted, draft_seconds, verify_seconds, free)
        if self.cost_cut and self.draft_cost.known and self.verify.known:
            span = min(self.max_k, CUT_SPAN)
            slope = (self.verify.at(span + 1) - self.verify.at(1)) / span
            rate = self.best_model_rate()
            self.cut = min(0.95, (self.draft_cost.value + slope) * rate / self.next_acceptance())
            # A tree's further child costs no draft forward, only its place in the verify: it pays where its path's
            # odds (the tokens it is expected to add) times the rate reach that slope.
            self.branch_cut = min(0.95, max(0.01, slope * rate))
            # A level's further node costs one more row of a draft forward that runs anyway, and its child's verify.
            row = self.draft_cost.value * self.draft_growth()
            self.feed_cut = min(0.95, max(0.01, (row + slope) * rate / self.next_acceptance()))

    def draft_growth(self) -> float:
        """What one more row adds to a draft forward, as a share of a one-row forward (over 1 to 1 + FEED_SPAN
        rows): the draft's calibrated curve, else the verify curve's shape over the same span."""
        shape = self.draft_shape or self.verify
        return max(0.0, shape.at(1 + FEED_SPAN) / max(shape.at(1), 1e-9) - 1.0) / FEED_SPAN

    def next_acceptance(self) -> float:
        """The chance that a token drafted after accepted ones is accepted too: the model's acceptance pooled
        over every position past the first (as often as each was reached), with the prior."""
        return max(self.model.pooled(first=1), 1e-3)

    def _choose(self) -> int:
        return self.max_k if super()._choose() else 0


class CalibratedDraftOrNot(DraftOrNot):
    """DraftOrNot on this machine's calibrated costs alone, never the clock: for `run`'s greedy requests one at a
    time, whose records must come out the same on every run of the same input. A verify costs what the target's
    calibrated curve says, a draft token what the draft's calibrated one-token forward costs (`draft_seconds`);
    the acceptance by position is the sequence's own. So the decisions follow the tokens and this machine's
    calibration file only (a sampled request's drafts decide its draws, so batch/generation.py keeps those on the
    odds alone: its record must not depend on the machine). Drafting only where the calibrated costs say it pays
    beats drafting up to max_k on the odds alone (docs/draft-length-and-policy.md)."""

    def __init__(self, draft_seconds: float, verify_curve: dict[int, float], **kwargs) -> None:
        self.draft_seconds = draft_seconds
        super().__init__(verify_curve=verify_curve, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.steady_cost.add(self.draft_seconds, 1.0)

    def update(self, drafted: int, accepted: int, draft_seconds: float | None, verify_seconds: float | None,
               free: bool = False) -> None:
        super().update(drafted, accepted, None, None, free)
