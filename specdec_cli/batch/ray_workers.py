"""`run --engine ray`: the requests answered by Ray actors, each holding the model pair once.

`RayWorkers` is a `Stream` (loop.py): it hands each request to the next idle worker and yields the
outcomes in input order, so the driver writes every record through the same writer, the moment it is
next. A worker runs `ModelGeneration`, the code of `--engine local`, and every request starts from
empty caches with its own seed, so a record does not depend on which worker made it.

A worker that dies mid-request (killed, out of memory) is restarted by Ray (it loads the pair again)
and the request goes to a worker once more; a request whose worker dies twice gets an error record and
the job goes on. Ray is imported only here, and only when used (`pip install 'specdec[ray]'`)."""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING

from specdec_cli.batch.generation import ModelGeneration
from specdec_cli.batch.loop import Outcome
from specdec_cli.batch.records import Completion
from specdec_cli.batch.requests import Request
from specdec_cli.engine.stats import GenerationStats
from specdec_cli.errors import InputError, MissingExtraError, ModelLoadError, SpecdecError, first_line

if TYPE_CHECKING:
    from specdec_cli.settings import DecodingSettings, ModelChoice

ATTEMPTS = 2  # a request whose worker dies this often gets an error record
POLL_SECONDS = 0.5  # how long the driver waits for a result before it lets Python see Ctrl-C / SIGTERM


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: a Ray of its own on this machine, for this job only
    workers: int | None = None  # None: as many as the cluster's CPUs (or GPUs) hold
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0


@dataclass
class WorkerReport:
    """One worker's share of the job, for the closing summary."""

    name: str  # host:pid of its first process
    records: int = 0
    lost: int = 0  # requests it died on (each retried, or failed after the second death)
    stats: GenerationStats = field(default_factory=GenerationStats)


def import_ray():
    try:
        import ray
    except ImportError:
        raise MissingExtraError("--engine ray needs Ray, which is not installed",
                                "pip install 'specdec[ray]' (on every machine of the cluster)") from None
    return ray


class Worker:
    """The actor (wrapped by `ray.remote` when the job starts): the pair, loaded once, answering one request
    at a time. Errors travel as text: a SpecdecError's own fields do not survive pickling."""

    def __init__(self, choice: ModelChoice, settings: DecodingSettings, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.load_error: str | None = None
        self.loaded = _Lines()
        try:
            self.generation = ModelGeneration.load(choice, settings, self.loaded)
        except SpecdecError as error:
            self.load_error = error.one_line()

    def ready(self) -> tuple[str, str | None, list[str]]:
        """Its name, why it could not load the pair (or None), and what it loaded (device, dtype, formats)."""
        return self.name, self.load_error, self.loaded.lines

    def generate(self, request: Request) -> tuple[Completion | None, str | None, float]:
        started = time.perf_counter()
        try:
            completion, error = self.generation(request), None
        except SpecdecError as failure:
            completion, error = None, failure.one_line()
        return completion, error, time.perf_counter() - started


class _Lines:
    """A printer that keeps what loading says, for the driver to compare and print once; `quiet`: no progress bars."""

    quiet = True

    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str, *, markup: bool = False) -> None:
        self.lines.append(text)


class RayWorkers:
    """`with RayWorkers(...) as workers:` — connected, the actors started and their pairs loaded; then
    `workers(requests)` is a `Stream`. Leaving the block kills the actors (and stops a Ray it started)."""

    def __init__(self, choice: ModelChoice, settings: DecodingSettings, options: RayOptions) -> None:
        self.choice, self.settings, self.options = choice, settings, options
        self.ray = import_ray()
        self.actors: list = []
        self.reports: list[WorkerReport] = []
        self.loaded: list[str] = []  # what every worker loaded (the same on each: checked)
        self._started_ray = False

    def __enter__(self) -> RayWorkers:
        self._started_ray = _connect(self.ray, self.options.address)
        try:
            self._start_actors()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False

    def _start_actors(self) -> None:
        options = self.options
        resources = self.ray.cluster_resources()
        count = options.workers or _workers_that_fit(resources, options)
        _check_fit(resources, options, count)
        remote = self.ray.remote(num_cpus=options.cpus_per_worker, num_gpus=options.gpus_per_worker,
                                 max_restarts=-1, max_task_retries=0)(Worker)
        threads = max(1, int(options.cpus_per_worker))
        self.actors = [remote.remote(self.choice, self.settings, threads) for _ in range(count)]
        try:
            started = self.ray.get([actor.ready.remote() for actor in self.actors])
        except self.ray.exceptions.RayActorError as error:
            raise ModelLoadError(f"a Ray worker could not start ({first_line(error)})",
                               "run with --debug to see why") from error
        for name, load_error, loaded in started:
            if load_error is not None:
                raise ModelLoadError(f"a Ray worker ({name}) could not load the models: {load_error}")
            self.reports.append(WorkerReport(name))
        self.loaded = _same_everywhere([(name, loaded) for name, _, loaded in started])

    def __call__(self, runnable: Sequence[Request]) -> Iterator[Outcome]:
        """Each request to the next idle worker; outcomes yielded in input order as soon as they are next."""
        job = _Job(runnable, idle=deque(range(len(self.actors))))
        for position in range(len(runnable)):
            while position not in job.done:
                self._hand_out(job)
                finished, _ = self.ray.wait(list(job.running), num_returns=1, timeout=POLL_SECONDS)
                for reference in finished:
                    worker, request = job.running.pop(reference)
                    if request is None:
                        self._welcome_back(job, reference, worker)
                    else:
                        self._collect(job, reference, worker, request)
            yield job.done.pop(position)

    def _hand_out(self, job: _Job) -> None:
        while job.idle and job.waiting:
            worker, request = job.idle.popleft(), job.waiting.popleft()
            job.running[self.actors[worker].generate.remote(job.requests[request])] = (worker, request)
        if job.waiting and not job.running:
            raise ModelLoadError("every Ray worker is gone: the restarted ones could not load the models again",
                               "the records so far are in OUTPUT; run the same command with --resume")

    def _collect(self, job: _Job, reference, worker: int, request: int) -> None:
        """The request's outcome, counted to its worker. A worker that died is probed until Ray has restarted
        it; its request goes to a worker again, or becomes an error record after its second death."""
        report = self.reports[worker]
        try:
            completion, error, seconds = self.ray.get(reference)
        except _lost_worker_errors(self.ray) as lost:
            report.lost += 1
            job.deaths[request] += 1
            if job.deaths[request] < ATTEMPTS:
                job.waiting.appendleft(request)
            else:
                job.done[request] = WorkerLostError(type(lost).__name__), 0.0
            # A plain call to a restarting actor fails at once; this one waits until it is back.
            job.running[self.actors[worker].ready.options(max_task_retries=-1).remote()] = (worker, None)
            return
        job.idle.append(worker)
        report.records += 1
        if completion is None:
            report.stats.seconds += seconds
            job.done[request] = SpecdecError(error), seconds
        else:
            report.stats.merge(completion.stats(seconds))
            job.done[request] = completion, seconds

    def _welcome_back(self, job: _Job, reference, worker: int) -> None:
        """A restarted worker that loaded the pair again takes requests again; one that could not stays out."""
        try:
            _, load_error, loaded = self.ray.get(reference)
        except _lost_worker_errors(self.ray):
            return
        if load_error is None and loaded == self.loaded:
            job.idle.append(worker)


@dataclass
class _Job:
    """The scheduler's state: positions in `requests`, which worker runs what, the outcomes not yet yielded."""

    requests: Sequence[Request]
    idle: deque[int]  # workers
    waiting: deque[int] = field(default_factory=deque)  # positions not handed out yet (a retry goes to the front)
    running: dict = field(default_factory=dict)  # ObjectRef -> (worker, position), or (worker, None) for a probe
    done: dict[int, Outcome] = field(default_factory=dict)
    deaths: collections.Counter = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self.waiting.extend(range(len(self.requests)))


class WorkerLostError(SpecdecError):
    def __init__(self, cause: str) -> None:
        super().__init__(f"the Ray worker running it died, twice ({cause})",
                         "the other records go on; a request that kills its worker may need more memory per worker")


def _same_everywhere(loaded: list[tuple[str, list[str]]]) -> list[str]:
    """What the workers loaded, when it is the same on all: an `auto` format, device or dtype resolved otherwise
    on another machine would make a record depend on the worker that wrote it."""
    first_name, first = loaded[0]
    for name, lines in loaded[1:]:
        if lines != first:
            ours, theirs = next(pair for pair in zip_longest(first, lines, fillvalue="nothing") if pair[0] != pair[1])
            raise InputError(f"the Ray workers loaded the models differently ({first_name}: {ours}; {name}: {theirs})",
                             "give --device, --dtype, --target-quant and --draft-quant so that every worker loads the same")
    return first


def _lost_worker_errors(ray) -> tuple[type[BaseException], ...]:
    """What `ray.get` raises when the worker process went away (killed, out of memory, its node lost)."""
    exceptions = ray.exceptions
    return (exceptions.RayActorError, exceptions.WorkerCrashedError, exceptions.OutOfMemoryError,
            exceptions.ObjectLostError, exceptions.NodeDiedError)


def _connect(ray, address: str | None) -> bool:
    """Join the cluster at `address` (None: start one on this machine); True when this call started Ray."""
    if ray.is_initialized():  # a caller (a test, a notebook) already did
        return False
    ours = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as error:
        where = f"at {address}" if address else "on this machine"
        raise InputError(f"cannot connect to a Ray cluster {where} ({first_line(error)})",
                         "start one with `ray start --head` (see README), or check --address") from None
    if ours is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, ours)  # ray.init replaces it: SIGTERM stops `run` as Ctrl-C does (exit 143)
    return True


def _check_fit(resources: dict, options: RayOptions, count: int) -> None:
    """Workers that the cluster cannot place would wait for ever: refuse them before any model loads."""
    for name, per_worker, flag in (("CPU", options.cpus_per_worker, "--cpus-per-worker"),
                                   ("GPU", options.gpus_per_worker, "--gpus-per-worker")):
        have = resources.get(name, 0)
        if count * per_worker > have:
            raise InputError(f"{count} Ray workers × {per_worker:g} {name} need {count * per_worker:g} {name}s, "
                             f"and the cluster has {have:g}", f"use fewer --workers or a smaller {flag}")


def _workers_that_fit(resources: dict, options: RayOptions) -> int:
    """As many workers as the cluster's GPUs (when each needs some) or CPUs hold; at least one."""
    if options.gpus_per_worker > 0:
        return max(1, int(resources.get("GPU", 0) // options.gpus_per_worker))
    return max(1, int(resources.get("CPU", 1) // options.cpus_per_worker))


