"""`specdec run INPUT.jsonl -o OUTPUT.jsonl`: batch generation, one durable output record per input line.

The work is in `specdec_cli.batch`; this module parses options, loads the models, and draws the
progress bar and the closing table on stderr."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from specdec_cli import batch
from specdec_cli.cli.app import (
    PIPE_CLOSED, PipeConsole, error_console, interrupted_exit_code, report_errors, sigterm_as_interrupt,
)
from specdec_cli.cli.options import (
    AllowPickleOption, DeviceOption, Draft4bitOption, DraftInt8Option, DraftQuantOption, TargetQuantOption, DraftOption, DrafterOption, DtypeOption, KOption,
    LoadIn4bitOption, LoadIn8bitOption, MaxNewTokensOption, ProfileOption, SeedOption, SystemOption,
    Target4bitOption, TargetOption, TemperatureOption, TopKOption, TopPOption, TrustRemoteCodeOption,
    PrefillOption,
)
from specdec_cli.errors import InputError, OutputClosed, OutputWriteError

if TYPE_CHECKING:
    from specdec_cli.settings import DecodingSettings, ModelChoice, ModelOverrides

_FILES = "Files"
_ENGINE = "Engine"
WRITE_FAILED = 3  # OUTPUT could not be written (disk full); 1 means "some records failed", 2 a usage mistake


@report_errors
def run_command(
    input: Annotated[str, typer.Argument(metavar="INPUT", help="JSONL requests, one per line; - reads stdin.", show_default=False)],
    output: Annotated[str, typer.Option("--output", "-o", help="JSONL file for the results (one line per request, in input order); - writes them to stdout.", rich_help_panel=_FILES, show_default=False)],
    resume: Annotated[bool, typer.Option("--resume", help="Continue OUTPUT: skip the requests it already answers.", rich_help_panel=_FILES)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUTPUT if it exists.", rich_help_panel=_FILES)] = False,
    force: Annotated[bool, typer.Option("--force", help="With --resume: continue OUTPUT even with other settings than it was made with.", rich_help_panel=_FILES)] = False,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N requests of INPUT.", rich_help_panel=_FILES)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary table.")] = False,
    profile: ProfileOption = None,
    target: TargetOption = None,
    draft: DraftOption = None,
    drafter: DrafterOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    target_4bit: Target4bitOption = False,
    draft_4bit: Draft4bitOption = False,
    load_in_4bit: LoadIn4bitOption = False,
    load_in_8bit: LoadIn8bitOption = False,
    draft_int8: DraftInt8Option = None,
    target_quant: TargetQuantOption = None,
    draft_quant: DraftQuantOption = None,
    prefill: PrefillOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    allow_pickle: AllowPickleOption = False,
    k: KOption = None,
    temperature: TemperatureOption = None,
    top_p: TopPOption = None,
    top_k: TopKOption = None,
    seed: SeedOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    system: SystemOption = None,
    engine: Annotated[str, typer.Option("--engine", help="local: in this process; ray: on Ray workers, each with the pair loaded once (needs the ray extra).", rich_help_panel=_ENGINE)] = "local",
    address: Annotated[str | None, typer.Option("--address", help="With --engine ray: the cluster to join (auto: the one `ray start` made here; ray://HOST:PORT). Default: a Ray of its own on this machine.", rich_help_panel=_ENGINE, show_default=False)] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="With --engine ray: how many workers. Default: as many as the cluster's CPUs (GPUs with --gpus-per-worker) hold.", rich_help_panel=_ENGINE, show_default=False)] = None,
    cpus_per_worker: Annotated[float | None, typer.Option("--cpus-per-worker", help="With --engine ray: CPUs per worker, also its torch threads. Default: 1.", rich_help_panel=_ENGINE, show_default=False)] = None,
    gpus_per_worker: Annotated[float | None, typer.Option("--gpus-per-worker", help="With --engine ray: GPUs per worker (0.5: two workers share one). Default: 0.", rich_help_panel=_ENGINE, show_default=False)] = None,
    batch_size: Annotated[str | None, typer.Option("--batch-size", "-b", help="Requests decoded together, a finished one replaced at once (1: one at a time, as chat decodes). Default auto: doubled from 1 while a forward of twice the rows gives 10% more tokens per second, by the costs specdec calibrate measured on this machine; 8 without a calibration.", rich_help_panel=_ENGINE, show_default=False)] = None,
) -> None:
    """Generate for every request in a JSONL file: {"id", "prompt" | "messages", ...} lines, OpenAI
    Batch API request lines, or both. Requests are decoded B at a time (--batch-size); each record is on
    disk, in input order, as soon as it and every record before it are done; after a crash or Ctrl-C,
    rerun with --resume. Exit code 1 when any record failed, 2 for a
    usage mistake, 3 when OUTPUT could not be written (disk full)."""
    ray_options = _ray_options(engine, address, workers, cpus_per_worker, gpus_per_worker)
    size = _batch_size(batch_size, ray_options is not None)
    output = _output_path(output)
    _check_paths(input, output, resume, overwrite)
    with sigterm_as_interrupt(), _output_lock(output):
        batch.check_output(output, resume, overwrite)  # again under the lock: another run may have just finished it
        from specdec_cli.settings import ModelOverrides  # torch: once the checks above passed, and never for --help

        models = ModelOverrides(
            profile=profile, target=target, draft=draft, drafter=drafter, device=device, dtype=dtype,
            target_quant=target_quant, draft_quant=draft_quant, prefill=prefill,
            target_4bit=target_4bit, draft_4bit=draft_4bit, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
            draft_int8=draft_int8, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
        )
        decoding = dict(k=k, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        max_new_tokens=max_new_tokens, system=system)  # for decoding_settings, once a profile is chosen
        _run_locked(input, output, resume, overwrite, force, limit, quiet, models, decoding, ray_options, size)


def _output_path(given: str) -> Path:
    """-o as given: `-` is standard output, as INPUT's `-` is standard input; `./-` is the file named `-` there (the
    shell's way to name it; pathlib drops the `./`, which made it standard output too)."""
    if given == "-":
        return batch.STDOUT
    path = Path(given)
    return Path.cwd() / path if path == batch.STDOUT else path


def _batch_size(given: str | None, on_ray: bool) -> int | str:
    """--batch-size as given: "auto" or a whole number of at least 1."""
    if given is None or given == "auto":
        return 1 if on_ray else "auto"
    try:
        size = int(given)
    except ValueError:
        raise InputError(f"--batch-size must be a whole number or auto, not {given!r}", "give e.g. --batch-size 8") from None
    if size < 1:
        raise InputError(f"--batch-size must be at least 1, not {size}", "give e.g. --batch-size 8, or 1 for one request at a time")
    if on_ray and size > 1:
        raise InputError("--batch-size is an option of --engine local (Ray workers answer one request at a time)",
                         "leave out --batch-size, or run with --engine local")
    return size


def _ray_options(engine: str, address: str | None, workers: int | None, cpus: float | None,
                 gpus: float | None) -> batch.RayOptions | None:
    """None for --engine local; the Ray options, checked (and Ray importable), for --engine ray."""
    if engine not in ("local", "ray"):
        raise InputError(f"unknown engine {engine!r}", "use --engine local or --engine ray")
    given = [flag for flag, value in (("--address", address), ("--workers", workers), ("--cpus-per-worker", cpus),
                                      ("--gpus-per-worker", gpus)) if value is not None]
    if engine == "local":
        if given:
            raise InputError(f"{given[0]} is an option of --engine ray", "add --engine ray, or leave it out")
        return None
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}", "give a number of Ray workers, or leave it out")
    if cpus is not None and not (math.isfinite(cpus) and cpus > 0):
        raise InputError(f"--cpus-per-worker must be more than 0, not {cpus:g}", "give a number such as 1 or 2")
    if gpus is not None and not (math.isfinite(gpus) and gpus >= 0):
        raise InputError(f"--gpus-per-worker must be 0 or more, not {gpus:g}", "give a number such as 1 or 0.5")
    batch.import_ray()
    return batch.RayOptions(address, workers, cpus or 1.0, gpus or 0.0)


def _run_locked(input: str, output: Path, resume: bool, overwrite: bool, force: bool, limit: int | None, quiet: bool,
                models: ModelOverrides, decoding: dict[str, object], ray_options: batch.RayOptions | None,
                batch_size: int | str) -> None:
    from specdec_cli.settings import choose_models, decoding_settings, resolve_formats

    lines = batch.read_input(input)
    requests = batch.read_requests(lines)
    batch.refuse_one_document(requests, lines, input)
    requests = requests[:limit]
    choice = resolve_formats(choose_models(models))  # stored and loaded as resolved here: no `auto` in a file's settings
    settings = decoding_settings(choice.profile, **decoding)
    finished = batch.read_finished(output) if resume else []
    current = batch.record_settings(choice, settings)
    pending = batch.pending_requests(requests, finished)
    if finished:  # before loading anything: resuming with other settings or another input is refused at once
        _check_resumed_settings(output, current, force)
        waiting = set(map(id, pending))
        _print_note(batch.check_resumed_requests(output, input, [r for r in requests if id(r) not in waiting], force))
    summary = batch.BatchSummary(
        total=len(requests), skipped=len(requests) - len(pending), failed_before=sum(map(batch.record_failed, finished))
    )
    console = PipeConsole(stderr=True, highlight=False, soft_wrap=True, quiet=quiet)
    runnable = any(request.error is None for request in pending)
    job = sum(request.error is None for request in requests)  # the whole input's, so a resume batches alike
    with _engine(choice, settings, ray_options, batch_size, console, runnable, job) as (stream, reports, together):
        _run_with_progress(pending, stream, output, overwrite, summary, choice.target, console, parallel=together,
                           settings=None if finished else current, resumed=bool(finished),
                           digests=batch.request_digests(requests, pending))
    _print_summary(summary, console, reports, together)
    _exit_on_failures(summary, output)


@contextmanager
def _engine(choice: ModelChoice, settings: DecodingSettings, ray_options: batch.RayOptions | None,
            batch_size: int | str, console: Console, runnable: bool, job: int,
            ) -> Iterator[tuple[batch.Stream, list[batch.WorkerReport], bool]]:
    """The stream that answers the requests, (on Ray) the workers' reports, filled in as they work, and whether
    requests run side by side (their seconds overlap: speed is then total tokens over wall time)."""
    if not runnable:
        yield batch.each(_never), [], False
    elif ray_options is None:
        generation = batch.BatchedGeneration.load(choice, settings, batch_size, console, requests=job)
        if isinstance(generation, batch.ModelGeneration):
            yield batch.each(generation), [], False
        else:
            yield generation, [], True
    else:
        with batch.RayWorkers(choice, settings, ray_options) as workers:
            console.print(f"ray: {len(workers.actors)} workers, each loaded:", markup=False)
            for line in workers.loaded:
                console.print(f"  {line}", markup=False)
            yield workers, workers.reports, True


def _check_paths(source: str, output: Path, resume: bool, overwrite: bool) -> None:
    if source != "-" and _same_file(Path(source), output):
        raise InputError("INPUT and OUTPUT are the same file", "write the results to another file with -o")
    batch.check_output(output, resume, overwrite)


def _same_file(source: Path, output: Path) -> bool:
    """One path spelt two ways, a symbolic link, or a hard link (two names of one file: --overwrite replaced the input
    with the records)."""
    if source.resolve() == output.resolve():
        return True
    try:
        return os.path.samefile(source, output)
    except OSError:  # one of them does not exist (yet)
        return False


def _output_lock(output: Path) -> AbstractContextManager:
    """The lock, for a regular file (or one to be made); a device such as /dev/null, or standard output, is no record
    file."""
    if output == batch.STDOUT:
        return nullcontext()
    return batch.OutputLock(output) if output.is_file() or not output.exists() else nullcontext()


def _check_resumed_settings(output: Path, current: dict, force: bool) -> None:
    """Resuming records: they must have been made with these settings."""
    _print_note(batch.check_resumed_settings(output, current, force))


def _print_note(note: str | None) -> None:
    if note:
        error_console().print(note, markup=False)


def _never(request: batch.Request) -> batch.Completion:  # pragma: no cover - only error requests are pending
    raise AssertionError("no request to generate for")


def _run_with_progress(pending, stream: batch.Stream, output: Path, replace: bool, summary: batch.BatchSummary,
                       model: str, console: Console, parallel: bool = False, settings: dict | None = None,
                       resumed: bool = False, digests: dict[str, str] | None = None) -> None:
    """settings: a file begun (or replaced) here stores them beside it, with `digests`, those of the requests it answers
    (a resumed one, `resumed`, only those), once the models loaded and the file is open (emptied by --overwrite): a
    run that fails before then leaves an earlier file's records and settings as they were."""
    with batch.DurableWriter(output, replace) as writer, _progress_bar(console) as progress:
        if settings is not None and output != batch.STDOUT and output.is_file():  # /dev/null, stdout: no settings file
            batch.write_settings(output, settings, digests)
        elif resumed and output != batch.STDOUT and output.is_file():
            batch.remember_requests(output, digests)
        task = progress.add_task("records", total=summary.total, completed=summary.done, speed="", acceptance="")

        def show(current: batch.BatchSummary) -> None:
            speed = current.wall_tokens_per_second if parallel else current.tokens_per_second  # across workers
            progress.update(task, completed=current.done, speed=f"{speed:.1f} tok/s",
                            acceptance=f"accept {_percent(current.acceptance_rate)}")

        try:
            batch.run_streamed(pending, stream, writer.write, summary, model, on_record=show)
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM as `Terminated`
            progress.stop()
            error_console().print(
                f"interrupted: {summary.done} of {summary.total} records are in {batch.output_name(output)}"
                + (" — run the same command with --resume to finish" if output != batch.STDOUT else ""), markup=False,
            )
            raise typer.Exit(interrupted_exit_code(interrupt)) from None
        except OutputClosed:  # `-o - | head`: the reader has what it wanted
            progress.stop()
            raise typer.Exit(PIPE_CLOSED) from None
        except OutputWriteError as error:
            progress.stop()
            error_console().print(
                f"error: {error.message} — the {summary.done} of {summary.total} records before it are intact; "
                f"{error.hint} to finish",
                markup=False,
            )
            raise typer.Exit(WRITE_FAILED) from None


def _progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[speed]}"), TextColumn("{task.fields[acceptance]}"), TimeRemainingColumn(),
        console=console, disable=console.quiet or not console.is_terminal,
    )


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def _print_summary(summary: batch.BatchSummary, console: Console, reports: list[batch.WorkerReport],
                   together: bool) -> None:
    table = Table(title="specdec run", show_header=False, title_justify="left")
    table.add_row("records", f"{summary.done} of {summary.total}"
                  + (f" ({summary.skipped} already done)" if summary.skipped else ""))
    table.add_row("failed", str(summary.failed + summary.failed_before))
    table.add_row("tokens", str(summary.completion_tokens))
    if reports:
        table.add_row("speed", f"{summary.wall_tokens_per_second:.1f} tok/s over {summary.wall_seconds:.1f} s "
                      f"on {len(reports)} Ray workers")
    elif together:
        table.add_row("speed", f"{summary.wall_tokens_per_second:.1f} tok/s over {summary.wall_seconds:.1f} s "
                      "(requests decoded in batches)")
    else:
        table.add_row("speed", f"{summary.tokens_per_second:.1f} tok/s over {summary.seconds:.1f} s")
    table.add_row("acceptance", _percent(summary.acceptance_rate))
    for number, report in enumerate(reports, 1):
        lost = f", died mid-request {report.lost}×" if report.lost else ""
        table.add_row(f"worker {number}", f"{report.records} records, {report.stats.tokens_per_second:.1f} tok/s "
                      f"({report.name}){lost}")
    console.print(table)


def _exit_on_failures(summary: batch.BatchSummary, output: Path) -> None:
    failed = summary.failed + summary.failed_before
    if failed:
        error_console().print(
            f"{failed} of {summary.total} records failed — their lines in {batch.output_name(output)} have finish_reason "
            '"error" (or an "error" object) saying why', markup=False,
        )
        raise typer.Exit(1)
