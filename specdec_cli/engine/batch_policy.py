"""Draft lengths for a batched step: each row's k, priced by what a batch of B such rows costs.

A batched step costs one target forward over every row's fed tokens (sum of k_r + 1) plus, when rows draft
with the draft model, a draft forward per draft position over the drafting rows. On a machine where a
forward of a few tokens costs about one, a few rows drafting a few tokens each ride along nearly free; as
the batch grows, the verify of B x (k + 1) tokens leaves its flat stretch, every drafted token then costs
real time, and k falls to 0 — speculation and batching are two uses of the same flat stretch.

`CostBatchK` decides for each row alone, as if all B rows of the batch drafted as it does: k maximises the
row's expected tokens (its own acceptance by position, from a prior) per its share of such a step,
verify(B (k+1)) / B plus k draft forwards of B rows / B (the first one also feeding what the draft model has
not seen of this row). A row's k depends on nothing but the row and the batch size — not on its batch mates,
not on the clock — so a sampled row draws the same tokens in any batch, and `run` keeps its promise that the
same input and seed give the same file (also after a resume, which decodes the rest in other batches).

Prices come from forward-cost curves ({tokens: seconds}: what `specdec calibrate` measured on this machine;
without one, assumed shapes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdec_cli.engine.costs import VerifyCost, _Positions

LOOKUP, MODEL = "lookup", "model"  # where a row's draft comes from this step
OPTIMISTIC = 0.95  # the acceptance a probe's "could drafting pay at all" assumes
CATCH_UP_STEPS = 8  # a row's draft catch-up is paid once; priced as spread over this many steps of drafting
PROBE_CATCH_UP = 32  # a probe feeds the draft model at most this many unseen tokens: a prompt's prefill is no probe


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

    def drafts_from_the_start(self) -> bool:
        return self.k > 0


class _Row:
    def __init__(self, max_k: int, max_lookup: int, prior_alpha: float, prior_weight: float) -> None:
        self.model = _Positions(max_k, prior_alpha, prior_weight)
        self.lookup = _Positions(max_lookup, prior_alpha, prior_weight)
        self.steps = 0


class CostBatchK:
    """Each row's k from its own acceptance and the cost of a step of `batch_size` rows like it (see the
    module's docstring). probe_every: every so many of a row's steps it drafts at least `probe_k` although
    nothing pays, if drafting could pay at all (at OPTIMISTIC acceptance), so its acceptance stays measured —
    but not with the draft model where it has yet to see the row (more than PROBE_CATCH_UP tokens): feeding it
    the prompt to test two tokens can cost more than the whole rest of a run's drafting gains.
    A lookup probe feeds the draft model nothing, so it probes whatever the draft model has seen."""

    def __init__(self, batch_size: int, verify_curve: dict[int, float] | None = None,
                 draft_curve: dict[int, float] | None = None, max_k: int = 12, max_lookup: int = 12,
                 prior_alpha: float = 0.6, prior_weight: float = 2.0, decay: float = 0.97, probe_every: int = 8,
                 probe_k: int = 2, device: str = "cpu") -> None:
        self.batch_size = batch_size
        verify_curve, draft_curve = _in_one_unit(verify_curve, draft_curve, device)
        self.verify = VerifyCost(verify_curve)
        self.draft = VerifyCost(draft_curve)
        self.max_k, self.max_lookup, self.prior_alpha, self.prior_weight = max_k, max_lookup, prior_alpha, prior_weight
        self.decay, self.probe_every, self.probe_k = decay, probe_every, probe_k
        self._rows: dict[int, _Row] = {}

    def plan(self, rows: Mapping[int, RowPlan]) -> dict[int, int]:
        return {row: self._k(self._row(row), plan) for row, plan in rows.items()}

    def update(self, row: int, drafted: int, accepted: int, source: str) -> None:
        if drafted:
            state = self._row(row)
            (state.lookup if source == LOOKUP else state.model).add(drafted, accepted, self.decay)

    def forget(self, row: int) -> None:
        self._rows.pop(row, None)

    def _row(self, row: int) -> _Row:
        if row not in self._rows:
            self._rows[row] = _Row(self.max_k, self.max_lookup, self.prior_alpha, self.prior_weight)
        return self._rows[row]

    def _k(self, state: _Row, plan: RowPlan) -> int:
        positions = state.lookup if plan.source == LOOKUP else state.model
        rates = positions.rates()[: plan.room]
        best = self._best(rates, plan)
        state.steps += 1
        if (not best and state.steps % self.probe_every == 0
                and (plan.source == LOOKUP or plan.catch_up <= PROBE_CATCH_UP)
                and self._best([OPTIMISTIC] * len(rates), plan)):
            return min(self.probe_k, plan.room)
        return best

    def _best(self, rates: list[float], plan: RowPlan) -> int:
        """The k with the most expected tokens per second of this row's share of a batch step."""
        best, best_rate, expected, survive = 0, self._rate(0, 1.0, plan), 1.0, 1.0
        for k, rate in enumerate(rates, start=1):
            survive *= rate
            expected += survive
            if (step_rate := self._rate(k, expected, plan)) > best_rate:
                best, best_rate = k, step_rate
        return best

    def drafts_from_the_start(self) -> bool:
        """Whether a fresh row (prior acceptance, nothing to catch up) drafts with the draft model at this batch
        size: then the draft model prefills each prompt when its row is admitted, else only when it first drafts."""
        return self._best(_Positions(self.max_k, self.prior_alpha, self.prior_weight).rates(), RowPlan(self.max_k, MODEL)) > 0

    def _rate(self, k: int, expected: float, plan: RowPlan) -> float:
        """Expected tokens per second of a step of B rows drafting as this one: the verify of B (k+1) tokens
        and k draft forwards of B tokens, plus this row's catch-up (what its draft model has not seen: paid
        once, spread over CATCH_UP_STEPS steps of drafting)."""
        rows = self.batch_size
        seconds = self.verify.at(rows * (k + 1))
        if k and plan.source == MODEL:
            seconds += k * self.draft.at(rows)
            if plan.catch_up > 1:
                seconds += (self.draft.at(rows - 1 + plan.catch_up) - self.draft.at(rows)) / CATCH_UP_STEPS
        return expected * rows / max(seconds, 1e-9)


# Without a measured curve, assumed shapes (used only until `specdec calibrate` measures): a forward of n tokens
# in units of one of 1 token, and a draft forward as a share of that. On a CPU a quantised target's verify grows
# with its tokens from a few on (the demo target's q4 forward of 16 tokens cost 2.5-2.7 of one on AMD EPYC and Intel
# Xeon: benchmarks/2026-12-02-forward-costs-avx512-interleaved.json, 2026-12-05-forward-costs-intel-amx.json; its
# 0.5B draft about 0.35 of the target), so a batch of 8 drafting several tokens a row costs far more than a flat
# curve says. Elsewhere (a GPU) one of 1 plus 5% a token, a draft forward 30% of that.
_ASSUMED = {
    "cpu": ({1: 1.0, 2: 1.07, 4: 1.3, 8: 1.7, 16: 2.7}, {1: 0.35, 2: 0.37, 4: 0.45, 8: 0.57, 16: 0.94}),
    "flat": ({1: 1.0, 16: 1.75}, {1: 0.3, 16: 0.525}),
}


def _in_one_unit(verify: dict[int, float] | None, draft: dict[int, float] | None,
                 device: str = "cpu") -> tuple[dict, dict]:
    """Both curves in one unit: a missing one is its assumed shape (`_ASSUMED`: the CPU's on "cpu", else the flat
    one) scaled to the measured one's one-token cost (a calibrated target in seconds beside the assumed draft share
    would price a draft forward at 0.35 s), both assumed where neither was measured."""
    assumed_verify, assumed_draft = _ASSUMED["cpu" if device == "cpu" else "flat"]
    if verify and not draft:
        scale = verify[min(verify)] / assumed_verify[1]
        draft = {n: seconds * scale for n, seconds in assumed_draft.items()}
    elif draft and not verify:
        scale = draft[min(draft)] / assumed_draft[1]
        verify = {n: seconds * scale for n, seconds in assumed_verify.items()}
    return verify or assumed_verify, draft or assumed_draft
