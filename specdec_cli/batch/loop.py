"""`run`'s loop: answer each request and write its record, in input order, before the next starts.

The generation is a seam: `Generate` takes a list of requests and returns, per request, its
`Completion` or the `SpecdecError` that stopped it. `run_grouped` hands it `size` requests at a time
(a batched engine can stand behind it without touching the writer). `run_batch` is the common case:
one request at a time through a per-request `GenerateOne` (e.g. `ModelGeneration`). Underneath both,
`run_streamed` takes a `Stream`: the runnable requests in, an iterator of (outcome, seconds) in input
order out, so a backend that works ahead (Ray workers) still has each record written the moment it is
next in order. No torch, no Rich."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from specdec_cli.batch.records import Completion, error_record, record_key, success_record
from specdec_cli.batch.requests import Request
from specdec_cli.engine.stats import GenerationStats
from specdec_cli.errors import SpecdecError

GenerateOne = Callable[[Request], Completion]
Generate = Callable[[Sequence[Request]], list["Completion | SpecdecError"]]
Outcome = tuple["Completion | SpecdecError", float]  # and the seconds it took
Stream = Callable[[Sequence[Request]], Iterator[Outcome]]
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
    wall_seconds: float = 0.0  # since this run's first request: less than stats.seconds when workers run side by side

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
    def wall_tokens_per_second(self) -> float:
        """Tokens per second of the whole job, across workers."""
        return self.completion_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

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
    return run_streamed(requests, each(generate), write, summary, model, on_record)


def each(generate: GenerateOne) -> Stream:
    """A `Stream` that answers one request at a time, each only when the loop asks for it."""
    return in_groups(one_at_a_time(generate), 1)


def run_grouped(requests: Sequence[Request], generate: Generate, write: Write, summary: BatchSummary,
                model: str = "", on_record: Callable[[BatchSummary], None] | None = None,
                size: int = 1) -> BatchSummary:
    """Answer the runnable requests `size` at a time, writing every record in input order as soon as its group is done."""
    return run_streamed(requests, in_groups(generate, size), write, summary, model, on_record)


def in_groups(generate: Generate, size: int) -> Stream:
    """A `Stream` that hands `generate` `size` requests at a time (a group's wall time shared evenly)."""

    def stream(runnable: Sequence[Request]) -> Iterator[Outcome]:
        for start in range(0, len(runnable), size):
            group = runnable[start:start + size]
            started = time.perf_counter()
            outcomes = generate(group)
            seconds = (time.perf_counter() - started) / len(group)
            yield from ((outcome, seconds) for outcome in outcomes)

    return stream


def run_streamed(requests: Sequence[Request], stream: Stream, write: Write, summary: BatchSummary,
                 model: str = "", on_record: Callable[[BatchSummary], None] | None = None) -> BatchSummary:
    """Answer the requests in input order: `stream` gets the runnable ones and yields their outcomes in that
    order (it may work ahead, e.g. on several workers); each record is written the moment it is next."""
    started = time.perf_counter()
    outcomes = stream([request for request in requests if request.error is None])
    for request in requests:
        if request.error is not None:
            record, completion, seconds = error_record(request, request.error), None, 0.0
        else:
            outcome, seconds = next(outcomes)
            record, completion = _answer(request, outcome, seconds, model)
        write(record)
        summary.add(completion, seconds)
        summary.wall_seconds = time.perf_counter() - started
        if on_record is not None:
            on_record(summary)
    return summary


def _answer(request: Request, outcome: Completion | SpecdecError, seconds: float, model: str) -> tuple[dict, Completion | None]:
    """A generated request's record and completion (None on error)."""
    if isinstance(outcome, SpecdecError):
        return error_record(request, f"line {request.line}: {outcome.one_line()}", "generation_failed"), None
    return success_record(request, outcome, seconds, model), outcome
