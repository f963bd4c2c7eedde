"""Batched speculative decoding: up to B sequences per forward, a finished row refilled at once.

Token ids in, token ids out, like decode.py, whose pieces it shares (acceptance, sampling, trimming,
stats). Each step, for all live rows together:
  1. plan    — the batch policy (batch_policy.py) gives each row its k (0: that row decodes plainly);
  2. draft   — lookups per row (free); the draft model for the other rows, one packed forward per draft
               position over the rows still drafting (each stops at its k or on its own odds);
  3. verify  — one packed target forward over every row's [last token, drafts];
  4. accept  — per row, the same acceptance rule as batch size 1, with the row's own sampling
               parameters and generator; then EOS, the stop callback and the budget, per row;
  5. learn   — the policy sees each row's outcome; a finished row leaves both caches and the next
               request takes its place before the next step (continuous batching).
Both models keep all rows in one packed cache each (packed.py): rollback and catch-up follow from the
shared-prefix rule, and a row's prompt is prefilled alone when it is admitted. As the one-sequence drafters
do, the draft model may score a subset of the vocabulary (`draft_ids`) and read a window of each row
(`draft_window`: the last tokens of its prompt and all after them); both are lossless.

A row's output does not depend on the other rows: greedy output equals batch size 1 (bit for bit with
the row-wise attention of int8/int4 targets, up to float rounding otherwise), and a row draws from its
own generator, seeded as `SpeculativeDecoder` seeds it. Its stats.seconds is its own wall time from its
admission to its last token."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec_cli.engine.acceptance import Verdict, greedy_verdict, sampling_verdict
from specdec_cli.engine.batch_policy import LOOKUP, MODEL, CostBatchK, FixedBatchK, RowPlan
from specdec_cli.engine.context import Budget, context_length, fit_budget, smallest_context
from specdec_cli.engine.decode import GenerationResult, StopCallback, provenance_of_next, trim_step
from specdec_cli.engine.draft import Draft
from specdec_cli.engine.events import Provenance, StepEvent
from specdec_cli.engine.gate import DraftingGate
from specdec_cli.engine.packed import PackedCache
from specdec_cli.engine.sampling import (SamplingParams, argmax_ids, draft_odds, logits_to_probs, make_generator,
                                         sample, spread)
from specdec_cli.engine.stats import GenerationStats
from specdec_cli.errors import PromptTooLongError

DRAFTERS = ("none", "model", "ngram", "cascade")
AUTO_SURVIVAL = 0.3  # as session.AUTO_SURVIVAL: with k = auto a row stops drafting on the draft's own odds
PREFILL_ALONE = 64  # a row's draft catch-up longer than this is prefilled on its own (chunked), not in the packed forward


class Lookup(Protocol):
    def lookup(self, ids: Sequence[int]) -> int | None:
        """Where the continuation of the sequence's longest matching suffix starts, or None."""


@dataclass(frozen=True)
class RowRequest:
    """One sequence for the batch: its prompt, sampling, budget and stop condition."""

    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    stop: StopCallback | None = None


@dataclass
class _Row:
    index: int
    request: RowRequest
    budget: Budget
    generator: torch.Generator
    started: float
    ids: list[int]
    lookup: Lookup | None = None  # the row's own lookup index (ngram, cascade)
    draft_start: int = 0  # the first of the row's ids the draft model reads (its window's start)
    tokens: list[int] = field(default_factory=list)
    provenance: list[Provenance] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.budget.max_new_tokens - len(self.tokens)


class BatchedDecoder:
    """Decodes up to `batch_size` sequences at once; a finished row takes the next request at once.

    drafter: "none" (the target alone), "model" (the draft model), "ngram" (lookup), "cascade" (lookup
    when it matches, else the draft model); k: an int (every row, every step) or "auto" (`CostBatchK`
    on the forward-cost curves: `verify_curve` the target's, `draft_curve` the draft's). lookup_factory:
    a new lookup index for each row (an `NgramDrafter`, which the engine cannot import: drafters sit
    above it), for the ngram and cascade drafters. draft_ids: the ids `draft`'s logits score, in order
    (a subset head, drafters/subset_head.py; None: the whole vocabulary). draft_window: the draft model
    reads only the last `draft_window` tokens of a row's prompt, and everything after them (None: all).
    reuse_prompts: the roles ("target", "draft") whose model computes each row alone (row-wise attention),
    so a prompt's prefix shared with the prompt admitted before it is not computed again (packed.py).
    gate: a `DraftingGate` that lets a step draft only where drafting measured faster than not (gate.py), read
    on `clock`; a sampled row with a seed never follows it (its draws depend on its drafts, and the same seed must
    give the same record), a greedy row's tokens do not depend on it, an unseeded row's draws are random anyway."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None = None, drafter: str = "none",
                 batch_size: int = 8, k: int | str = "auto", eos_token_ids: Sequence[int] = (),
                 verify_curve: dict[int, float] | None = None, draft_curve: dict[int, float] | None = None,
                 lookup_factory: Callable[[], Lookup] | None = None, draft_ids: torch.Tensor | None = None,
                 draft_window: int | None = None, reuse_prompts: Sequence[str] = (),
                 gate: DraftingGate | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown batched drafter {drafter!r} (one of {', '.join(DRAFTERS)})")
        if drafter in ("model", "cascade") and draft is None:
            raise ValueError(f"the {drafter} drafter needs a draft model")
        if drafter in ("ngram", "cascade") and lookup_factory is None:
            raise ValueError(f"the {drafter} drafter needs a lookup_factory (a new lookup index per row)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.drafter = "none" if k == 0 else drafter
        self.batch_size = batch_size
        self.lookup_factory = lookup_factory
        self.eos_token_ids = frozenset(eos_token_ids)
        self.target = PackedCache(target, reuse_prompts="target" in reuse_prompts)
        uses_model = self.drafter in ("model", "cascade")
        self.draft = PackedCache(draft, reuse_prompts="draft" in reuse_prompts) if uses_model else None
        self.draft_ids = None if draft_ids is None else draft_ids.cpu()
        self.draft_width = None if draft_ids is None else int(self.draft_ids.max()) + 1
        self.draft_window = draft_window
        self.min_survival = AUTO_SURVIVAL if k == "auto" else 0.0
        self.context = smallest_context(context_length(target), context_length(draft) if uses_model else None)
        device = next(target.parameters()).device.type  # the shape of the curves assumed where none was measured
        self.policy = (CostBatchK(batch_size, verify_curve, draft_curve, device=device) if k == "auto"
                       else FixedBatchK(int(k)))
        self.draft_from_the_start = self.policy.drafts_from_the_start()
        self.gate = gate if self.drafter != "none" else None
        self.clock = clock
        self._draft_admitting = 0.0  # seconds the draft model spent on admitted prompts, owed by the next drafting step

    def stream(self, requests: Iterable[RowRequest]) -> Iterator[tuple[int, GenerationResult | Exception]]:
        """(index in `requests`, result) for each request, in the order they finish. A request the models
        cannot take (a prompt past the context, an empty one) gets its error instead. When a step fails (out of
        memory; one request's sampling meeting a NaN), each row it held is decoded again from its start, alone,
        before any other request comes in: a row that fails alone gets the error, the others their results."""
        pending = iter(enumerate(requests))
        live: dict[int, _Row] = {}
        alone: list[tuple[int, RowRequest]] = []  # the rows of a failed step, to decode again one at a time
        retried: set[int] = set()  # those admitted again: each runs with no other row until it is done
        while True:
            if alone and not live:
                retried.add(alone[0][0])
                admitting = [alone.pop(0)]
            elif alone or retried & live.keys():
                admitting = []
            else:
                admitting = _take(pending, self.batch_size - len(live))
            for index, request in admitting:
                try:
                    live[index] = self._admit(index, request, len(live) + len(admitting))
                except (PromptTooLongError, ValueError) as error:
                    yield index, error
            if not live:
                if alone:
                    continue
                return
            try:
                finished = self._step(live)
            except (RuntimeError, MemoryError, IndexError) as error:
                rows = [live.pop(index) for index in list(live)]
                for row in rows:
                    self._release(row)
                if len(rows) == 1:
                    yield rows[0].index, error
                else:
                    alone += [(row.index, row.request) for row in rows]
                continue
            for row in finished:
                self._release(live.pop(row.index))
                row.stats.seconds = self.clock() - row.started
                yield row.index, GenerationResult(row.tokens, row.provenance, row.finish_reason, row.stats, row.budget)

    def generate_many(self, requests: Sequence[RowRequest]) -> list[GenerationResult]:
        """`stream`, collected in input order (the first error raised)."""
        results = dict(self.stream(requests))
        for index in range(len(requests)):
            if isinstance(results[index], Exception):
                raise results[index]
        return [results[index] for index in range(len(requests))]

    def _admit(self, index: int, request: RowRequest, rows: int = 1) -> _Row:
        if not request.prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        started = self.clock()
        budget = fit_budget(len(request.prompt_ids), request.max_new_tokens, self.context)
        prompt = list(request.prompt_ids)
        # The last prompt token goes into the row's first step, with its drafts, like any step's last token.
        # The draft model sees the prompt now if rows draft from the start at this batch size, else when the
        # row first drafts (a large batch may never draft: it pays no draft prefill).
        self.target.admit(index, prompt[:-1])
        draft_start = max(len(prompt) - self.draft_window, 0) if self.draft_window else 0
        if self.draft is not None:
            drafting = self.draft_from_the_start and (self.gate is None or self.gate.drafts(rows))
            admitted_at = self.clock()
            self.draft.admit(index, prompt[draft_start:-1] if drafting else [])
            self._draft_admitting += self.clock() - admitted_at
        lookup = self.lookup_factory() if self.drafter in ("ngram", "cascade") else None
        return _Row(index, request, budget, make_generator(request.params.seed), started, prompt, lookup, draft_start)

    def _release(self, row: _Row) -> None:
        self.target.release(row.index)
        if self.draft is not None:
            self.draft.release(row.index)
        self.policy.forget(row.index)

    def _step(self, live: dict[int, _Row]) -> list[_Row]:
        started = self.clock()
        lookups = {index: row.lookup.lookup(row.ids) for index, row in live.items() if row.lookup is not None}
        plans = {index: RowPlan(max(row.remaining - 1, 0), _source(self.drafter, lookups.get(index)), self._unseen(row))
                 for index, row in live.items()}
        ks = self.policy.plan(plans) if self.drafter != "none" else dict.fromkeys(live, 0)
        held = self.gate is not None and not self.gate.drafts(len(live))
        if held:  # drafting measured slower than not at this occupancy: the rows the gate may hold decode plainly
            ks = {index: k if _keeps_its_drafts(live[index]) else 0 for index, k in ks.items()}
        drafts = {index: Draft([]) for index in live}
        for index, start in lookups.items():
            if start is not None and ks[index]:
                drafts[index] = Draft(live[index].ids[start: start + ks[index]], free=True)
        drafts.update(self._draft_with_model({index: k for index, k in ks.items() if k and plans[index].source == MODEL}, live))
        drafted_at = self.clock()
        logits = self.target.extend({index: row.ids + drafts[index].ids for index, row in live.items()},
                                    {index: len(drafts[index]) + 1 for index in live})
        verified_at = self.clock()
        finished, committed = [], 0
        reason = self.gate.reason(len(live)) if held else None
        for index, row in live.items():
            draft = drafts[index]
            verdict = _verdict(draft, logits[index], row)
            self.policy.update(index, len(draft), verdict.accepted, LOOKUP if draft.free else MODEL)
            before = len(row.tokens)
            why = reason if held and not _keeps_its_drafts(row) else None
            self._advance(row, draft, verdict, drafted_at - started, verified_at - drafted_at, why)
            committed += len(row.tokens) - before
            if row.finish_reason is not None:
                finished.append(row)
        self._judge(len(live), any(len(draft) for draft in drafts.values()), committed, self.clock() - started)
        return finished

    def _judge(self, rows: int, drafted: bool, committed: int, seconds: float) -> None:
        """The gate sees the step; a drafting step also pays what the draft model spent on admitted prompts."""
        if self.gate is None:
            return
        if drafted:
            seconds, self._draft_admitting = seconds + self._draft_admitting, 0.0
        self.gate.record(rows, drafted, committed, seconds)

    def _unseen(self, row: _Row) -> int:
        """Tokens of the row the draft model has not seen: what its next draft forward feeds first."""
        if self.draft is None:
            return 0
        read = row.ids[row.draft_start:]
        return len(read) - self.draft.shared_prefix(row.index, read)

    def _draft_with_model(self, ks: dict[int, int], live: dict[int, _Row]) -> dict[int, Draft]:
        """Each row in `ks` drafts up to its k with the draft model: one packed forward per position over
        the rows still drafting; a row stops early when the draft's own odds of its tokens fall below
        `min_survival` (k = auto)."""
        drafted = {index: [] for index in ks}
        rows_of_probs: dict[int, list[torch.Tensor]] = {index: [] for index in ks}
        survival = dict.fromkeys(ks, 1.0)
        active = list(ks)
        read = {index: live[index].ids[live[index].draft_start:] for index in ks}  # what the draft model reads
        for index in active:
            if self._unseen(live[index]) > PREFILL_ALONE:  # a long catch-up (the prompt) in chunks, on its own
                self.draft.admit(index, read[index][:-1])
        while active:
            logits = self.draft.extend({index: read[index] + drafted[index] for index in active},
                                       dict.fromkeys(active, 1))
            still = []
            for index in active:
                params, row_logits = live[index].request.params, logits[index][-1]
                if params.greedy:
                    choice = argmax_ids(row_logits)[0]
                else:
                    probs = logits_to_probs(row_logits, params)
                    choice = sample(probs, live[index].generator)
                    rows_of_probs[index].append(self._on_draft_vocabulary(probs))
                token = choice if self.draft_ids is None else int(self.draft_ids[choice])
                drafted[index].append(token)
                if len(drafted[index]) == ks[index]:
                    continue
                # the draft's odds before top-k and top-p, as the one-sequence drafter reads them (sampling.draft_odds)
                survival[index] *= float(draft_odds(row_logits, params)[choice]) if self.min_survival else 1.0
                if survival[index] >= self.min_survival:
                    still.append(index)
            active = still
        return {index: Draft(drafted[index], torch.stack(rows_of_probs[index]) if rows_of_probs[index] else None)
                for index in ks}

    def _on_draft_vocabulary(self, probs: torch.Tensor) -> torch.Tensor:
        """(V,) probabilities over the draft's own ids: a subset head's scattered back (0 off the subset)."""
        if self.draft_ids is None:
            return probs
        return spread(probs, self.draft_ids, self.draft_width)

    def _advance(self, row: _Row, draft: Draft, verdict: Verdict, draft_seconds: float, verify_seconds: float,
                 held: str | None = None) -> None:
        """The row takes the step's tokens, cut at EOS, the budget or its stop callback (`held`: why the gate kept
        it from drafting, if it did)."""
        tokens = draft.ids[: verdict.accepted] + [verdict.next_token]
        provenance = [Provenance.ACCEPTED] * verdict.accepted + [provenance_of_next(draft, verdict)]
        tokens, provenance, finish_reason = trim_step(tokens, provenance, row.remaining, self.eos_token_ids)
        row.tokens.extend(tokens)
        row.provenance.extend(provenance)
        row.ids.extend(tokens)
        stop = row.request.stop
        if finish_reason is None and stop is not None and stop(row.tokens):
            finish_reason = "stop"
        if finish_reason is None and row.remaining <= 0:
            finish_reason = "length"
        row.finish_reason = finish_reason
        row.stats.add_step(StepEvent(tokens, provenance, len(draft), verdict.accepted, draft_seconds,
                                     verify_seconds, finish_reason, draft.free, held=held))


def _verdict(draft: Draft, target_logits: torch.Tensor, row: _Row) -> Verdict:
    """The acceptance rule of batch size 1, on this row's (k+1, V) logits and with its own generator."""
    params = row.request.params
    if params.greedy:
        return greedy_verdict(draft.ids, target_logits)
    return sampling_verdict(draft.ids, draft.probs, logits_to_probs(target_logits, params), row.generator)


def _keeps_its_drafts(row: _Row) -> bool:
    """A sampled row with a seed drafts as the batch policy says whatever the gate measured: its drafts decide
    which draws it takes, and the same seed must give the same record."""
    params = row.request.params
    return not params.greedy and params.seed is not None


def _source(drafter: str, lookup_start: int | None) -> str:
    if drafter == "ngram" or (drafter == "cascade" and lookup_start is not None):
        return LOOKUP
    return MODEL


def _take(pending: Iterator, count: int) -> list:
    taken = []
    for _ in range(max(count, 0)):
        item = next(pending, None)
        if item is None:
            break
        taken.append(item)
    return taken
