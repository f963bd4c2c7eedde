"""Draft lengths for a batched step: one k per row, chosen together, because the rows share one verify.

A batched step costs one target forward over every row's fed tokens (sum of k_r + 1) plus, when any row
drafts with the draft model, max_r k_r draft forwards over the drafting rows. On a machine where a
forward of a few tokens costs about one, a few rows drafting a few tokens each ride along nearly free;
as the batch grows, the verify of B x (k + 1) tokens leaves its flat stretch, every drafted token then
costs real time, and the rows' k fall to 0 — speculation and batching are two uses of the same flat
stretch. `CostBatchK` spends it where it pays: it adds draft tokens one at a time to the row whose next
token is likeliest to survive (its acceptance by position, its own counts blended with all rows'), and
keeps the allocation with the most expected tokens per second of step.

Prices come from forward-cost curves ({tokens: seconds}: what `specdec calibrate` measured on this
machine, else measured when the models were loaded) — never from the run's clock unless asked
(`scale_by_run`), so the same input gives the same drafts and hence the same draws when sampling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specdec_cli.engine.policy import VerifyCost, _Positions

LOOKUP, MODEL = "lookup", "model"  # where a row's draft comes from this step
OPTIMISTIC = 0.95  # the acceptance a probe's "could drafting pay at all" assumes


@dataclass(frozen=True)
class RowPlan:
    room: int          # most draft tokens this row may take (its remaining budget minus the target's own token)
    source: str        # LOOKUP (free to draft) or MODEL
    catch_up: int = 1  # tokens the draft model's first forward must feed for this row (all it has not seen)


class FixedBatchK:
    """Every row drafts k (lookups: `lookup_k`), within its room."""

    def __init__(self, k: int, lookup_k: int = 8) -> None:
        self.k, self.lookup_k = k, lookup_k

    def plan(self, rows: Mapping[int, RowPlan]) -> dict[int, int]:
        return {row: min(self.lookup_k if plan.source == LOOKUP else self.k, plan.room) for row, plan in rows.items()}

    def update(self, row: int, drafted: int, accepted: int, source: str) -> None:
        pass

    def forget(self, row: int) -> None:
        pass

    def observe(self, verified_tokens: int, seconds: float | None) -> None:
        pass


@dataclass
class _RowAcceptance:
    model: _Positions
    lookup: _Positions


@dataclass
class CostBatchK:
    """Per-row k maximising the batch's expected tokens per second of step (see the module's docstring).

    row_weight: how many of its own steps a row's counts weigh against all rows' (its prior).
    probe_every: every so many steps the row likeliest to accept drafts at least `probe_k` even when
    nothing pays, so that acceptance stays measured and drafting comes back when the batch thins."""

    verify_curve: dict[int, float] | None = None
    draft_curve: dict[int, float] | None = None
    max_k: int = 12
    max_lookup: int = 12
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    row_weight: float = 4.0
    decay: float = 0.97
    probe_every: int = 8
    probe_k: int = 2
    scale_by_run: bool = False
    _rows: dict[int, _RowAcceptance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = _Positions(self.max_k, self.prior_alpha, self.prior_weight)
        self.lookups = _Positions(self.max_lookup, self.prior_alpha, self.prior_weight)
        self.verify = VerifyCost(self.verify_curve or _FLAT)
        self.draft = VerifyCost(self.draft_curve or _DRAFT_SHARE)
        self.steps = 0

    def plan(self, rows: Mapping[int, RowPlan]) -> dict[int, int]:
        """k per row: draft tokens added greedily by their odds of surviving, the best prefix kept."""
        odds = {row: self._survival(row, plan) for row, plan in rows.items()}
        best = self._allocate(rows, odds)
        self.steps += 1
        if self.steps % self.probe_every == 0 and rows and not any(best.values()) and self._could_pay(rows):
            likeliest = max(odds, key=lambda row: odds[row][0] if odds[row] else 0.0)
            best[likeliest] = min(self.probe_k, rows[likeliest].room)
        return best

    def _allocate(self, rows: Mapping[int, RowPlan], odds: Mapping[int, list[float]]) -> dict[int, int]:
        steps = sorted(((chance, row) for row, chances in odds.items() for chance in chances), reverse=True)
        ks = dict.fromkeys(rows, 0)
        best, best_rate, expected = dict(ks), self._rate(ks, rows, len(rows)), float(len(rows))
        for chance, row in steps:
            ks[row] += 1
            expected += chance
            rate = self._rate(ks, rows, expected)
            if rate > best_rate:
                best, best_rate = dict(ks), rate
        return best

    def _could_pay(self, rows: Mapping[int, RowPlan]) -> bool:
        """Whether drafting would pay were every draft token accepted (else a probe only costs: a batch whose
        verify is past its flat stretch, or a draft model as dear as the target)."""
        certain = {row: [OPTIMISTIC ** (position + 1) for position in range(plan.room)] for row, plan in rows.items()}
        return any(self._allocate(rows, certain).values())

    def update(self, row: int, drafted: int, accepted: int, source: str) -> None:
        if not drafted:
            return
        mine = self._rows.setdefault(row, _RowAcceptance(_Positions(self.max_k, 0.0, 0.0),
                                                         _Positions(self.max_lookup, 0.0, 0.0)))
        (self.lookups if source == LOOKUP else self.model).add(drafted, accepted, self.decay)
        (mine.lookup if source == LOOKUP else mine.model).add(drafted, accepted, self.decay)

    def forget(self, row: int) -> None:
        self._rows.pop(row, None)

    def observe(self, verified_tokens: int, seconds: float | None) -> None:
        """A step's verify seconds: they scale the curve only with `scale_by_run` (they read the clock)."""
        if self.scale_by_run and seconds is not None:
            self.verify.add(verified_tokens, seconds, self.decay)

    def _survival(self, row: int, plan: RowPlan) -> list[float]:
        """The odds that each further draft token of this row survives (products of the blended rates)."""
        everyone = (self.lookups if plan.source == LOOKUP else self.model).rates()
        mine = self._rows.get(row)
        own = (mine.lookup if plan.source == LOOKUP else mine.model) if mine else None
        chances, survive = [], 1.0
        for position in range(min(plan.room, len(everyone))):
            rate = everyone[position]
            if own is not None:
                reached, kept = own.reached[position], own.kept[position]
                rate = (kept + self.row_weight * rate) / (reached + self.row_weight)
            survive *= rate
            chances.append(survive)
        return chances

    def _rate(self, ks: Mapping[int, int], rows: Mapping[int, RowPlan], expected: float) -> float:
        """Expected tokens per second of a step: the verify of every row's k + 1 tokens, and the draft model's
        forwards — the first feeds each drafting row what it has not seen (a row that skipped steps catches
        up), each later one a token per row still drafting."""
        fed = sum(k + 1 for k in ks.values())
        drafting = [row for row, k in ks.items() if rows[row].source == MODEL and k]
        draft_seconds = 0.0
        if drafting:
            deepest = max(ks[row] for row in drafting)
            draft_seconds = (self.draft.at(sum(rows[row].catch_up for row in drafting))
                             + (deepest - 1) * self.draft.at(len(drafting)))
        return expected / max(self.verify.at(fed) + draft_seconds, 1e-9)


# Without a measured curve: a forward of n tokens as one of 1 plus 5% a token (a flat-ish CPU or GPU
# verify), a draft forward 30% of that — assumptions, used only until a curve is measured.
_FLAT = {1: 1.0, 16: 1.75}
_DRAFT_SHARE = {1: 0.3, 16: 0.525}
