"""`run`'s loop: answer each request and write its record, in input order, before the next starts.

The generation is a seam: `Generate` takes a list of requests and returns, per request, its
`Completion` or the `SpecdecError` that stopped it. `run_grouped` hands it `size` requests at a time
(a batched engine or an external backend can stand behind it without touching the writer); every
record of a group is written, in order, before the next group starts. `run_batch` is the common case:
one request at a time through a per-request `GenerateOne` (e.g. `ModelGeneration`). No torch, no Rich."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec_cli.batch.records import Completion, error_record, record_key, success_record
from specdec_cli.batch.requests import Request
from specdec_cli.engine.stats import GenerationStats
from specdec_cli.errors import SpecdecError

GenerateOne = Callable[[Request], Completion]
Generate = Callable[[Sequence[Request]], list["Completion | SpecdecError"]]
Write = Callable[[dict], None]


def one_at_a_time(generate: GenerateOne) -> Generate:
    """A `Generate` from a per-request one. A SpecdecError is that request's outcome; any other
    exception is a bug and propagates."""

    def generate_each(requests: Sequence[Request]) -> list[Completion | SpecdecError]:
        outcomes: list[Completion | SpecdecError] = []
        for request in requests:
            try:
                outcomes.append(generate(request))
            except SpecdecError as error:
                outcomes.append(error)
        return outcomes

    return generate_each


@dataclass
class BatchSummary:
    """Counts for the progress bar and the closing table; the generated requests' numbers in `stats`."""

    total: int = 0  # input records (after --limit)
    skipped: int = 0  # already in OUTPUT (--resume)
    written: int = 0
    failed: int = 0  # error records written by this run
    failed_before: int = 0  # error records already in OUTPUT
    stats: GenerationStats = field(default_factory=GenerationStats)  # seconds include failed requests'

    @property
    def done(self) -> int:
        return self.skipped + self.written

    @property
    def completion_tokens(self) -> int:
        return self.stats.new_tokens

    @property
    def seconds(self) -> float:
        return self.stats.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.stats.tokens_per_second

    @property
    def acceptance_rate(self) -> float | None:
        return self.stats.acceptance_rate if self.stats.drafted else None

    def add(self, completion: Completion | None, seconds: float) -> None:
        self.written += 1
        if completion is None:
            self.failed += 1
            self.stats.seconds += seconds
        else:
            self.stats.merge(completion.stats(seconds))


def pending_requests(requests: Sequence[Request], finished: Sequence[dict]) -> list[Request]:
    """The requests OUTPUT does not answer yet. Matching counts occurrences of each key, so a
    duplicate id's error record is written exactly once too."""
    answered = Counter(record_key(record) for record in finished)
    pending = []
    for request in requests:
        if answered[request.key] > 0:
            answered[request.key] -= 1
        else:
            pending.append(request)
    return pending


def run_batch(requests: Sequence[Request], generate: GenerateOne, write: Write, summary: BatchSummary,
              model: str = "", on_record: Callable[[BatchSummary], None] | None = None) -> BatchSummary:
    """Answer each request in order, writing each record before the next request starts."""
    return run_grouped(requests, one_at_a_time(generate), write, summary, model, on_record)


def run_grouped(requests: Sequence[Request], generate: Generate, write: Write, summary: BatchSummary,
                model: str = "", on_record: Callable[[BatchSummary], None] | None = None,
                size: int = 1) -> BatchSummary:
    """Answer the requests `size` at a time, writing every record in input order before the next group."""
    for start in range(0, len(requests), size):
        for record, completion, seconds in _answer_group(requests[start:start + size], generate, model):
            write(record)
            summary.add(completion, seconds)
            if on_record is not None:
                on_record(summary)
    return summary


def _answer_group(group: Sequence[Request], generate: Generate, model: str) -> list[tuple[dict, Completion | None, float]]:
    """Each request's record, completion (None on error) and wall time (a group's time shared evenly)."""
    runnable = [request for request in group if request.error is None]
    started = time.perf_counter()
    outcomes = iter(generate(runnable) if runnable else [])
    seconds = (time.perf_counter() - started) / max(len(runnable), 1)
    answers = []
    for request in group:
        if request.error is not None:
            answers.append((error_record(request, request.error), None, 0.0))
            continue
        outcome = next(outcomes)
        if isinstance(outcome, SpecdecError):
            message = f"line {request.line}: {outcome.one_line()}"
            answers.append((error_record(request, message, "generation_failed"), None, seconds))
        else:
            answers.append((success_record(request, outcome, seconds, model), outcome, seconds))
    return answers
