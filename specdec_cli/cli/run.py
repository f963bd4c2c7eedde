"""`specdec run INPUT.jsonl -o OUTPUT.jsonl`: batch generation, one durable output record per input line.

The work is in `specdec_cli.batch`; this module parses options, loads the models, and draws the
progress bar and the closing table on stderr."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from specdec_cli import batch
from specdec_cli.cli.app import error_console, interrupted_exit_code, report_errors, sigterm_as_interrupt
from specdec_cli.cli.options import (
    AllowPickleOption, DeviceOption, Draft4bitOption, DraftInt8Option, DraftQuantOption, TargetQuantOption, DraftOption, DrafterOption, DtypeOption, KOption,
    LoadIn4bitOption, LoadIn8bitOption, MaxNewTokensOption, ProfileOption, SeedOption, SystemOption,
    Target4bitOption, TargetOption, TemperatureOption, TopKOption, TopPOption, TrustRemoteCodeOption,
    decoding_overrides, model_overrides,
)
from specdec_cli.errors import InputError, OutputWriteError
from specdec_cli.settings import ModelOverrides, choose_models, decoding_settings

_FILES = "Files"
WRITE_FAILED = 3  # OUTPUT could not be written (disk full); 1 means "some records failed", 2 a usage mistake


@report_errors
def run_command(
    input: Annotated[str, typer.Argument(metavar="INPUT", help="JSONL requests, one per line; - reads stdin.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="JSONL file for the results (one line per request, in input order).", rich_help_panel=_FILES, show_default=False)],
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
    trust_remote_code: TrustRemoteCodeOption = False,
    allow_pickle: AllowPickleOption = False,
    k: KOption = None,
    temperature: TemperatureOption = None,
    top_p: TopPOption = None,
    top_k: TopKOption = None,
    seed: SeedOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    system: SystemOption = None,
) -> None:
    """Generate for every request in a JSONL file: {"id", "prompt" | "messages", ...} lines, OpenAI
    Batch API request lines, or both. Each record is on disk before the next request starts; after a
    crash or Ctrl-C, rerun with --resume. Exit code 1 when any record failed, 2 for a
    usage mistake, 3 when OUTPUT could not be written (disk full)."""
    _check_paths(input, output, resume, overwrite)
    with sigterm_as_interrupt(), _output_lock(output):
        batch.check_output(output, resume, overwrite)  # again under the lock: another run may have just finished it
        _run_locked(input, output, resume, overwrite, force, limit, quiet, model_overrides(locals()),
                    decoding_overrides(locals()))


def _run_locked(input: str, output: Path, resume: bool, overwrite: bool, force: bool, limit: int | None, quiet: bool,
                models: ModelOverrides, decoding: dict) -> None:
    requests = batch.read_requests(batch.read_input(input))[:limit]
    choice = choose_models(models)
    settings = decoding_settings(choice.profile, **decoding)
    finished = batch.read_finished(output) if resume else []
    _check_or_store_settings(output, batch.record_settings(choice, settings), bool(finished), force)
    pending = batch.pending_requests(requests, finished)
    summary = batch.BatchSummary(
        total=len(requests), skipped=len(requests) - len(pending), failed_before=sum(map(batch.record_failed, finished))
    )
    console = Console(stderr=True, highlight=False, soft_wrap=True, quiet=quiet)
    runnable = any(request.error is None for request in pending)
    generate = batch.ModelGeneration.load(choice, settings, console) if runnable else _never
    _run_with_progress(pending, generate, output, overwrite, summary, choice.target, console)
    _print_summary(summary, console)
    _exit_on_failures(summary, output)


def _check_paths(source: str, output: Path, resume: bool, overwrite: bool) -> None:
    if source != "-" and Path(source).resolve() == output.resolve():
        raise InputError("INPUT and OUTPUT are the same file", "write the results to another file with -o")
    batch.check_output(output, resume, overwrite)


def _output_lock(output: Path) -> AbstractContextManager:
    """The lock, for a regular file (or one to be made); a device such as /dev/null is no record file."""
    return batch.OutputLock(output) if output.is_file() or not output.exists() else nullcontext()


def _check_or_store_settings(output: Path, current: dict, resuming: bool, force: bool) -> None:
    """Resuming records: they must have been made with these settings. Starting a file: store them beside it."""
    if resuming:
        note = batch.check_resumed_settings(output, current, force)
        if note:
            error_console().print(note, markup=False)
    elif output.is_file() or not output.exists():  # a device such as /dev/null gets no settings file
        batch.write_settings(output, current)


def _never(request: batch.Request) -> batch.Completion:  # pragma: no cover - only error requests are pending
    raise AssertionError("no request to generate for")


def _run_with_progress(pending, generate, output: Path, replace: bool, summary: batch.BatchSummary, model: str,
                       console: Console) -> None:
    with batch.DurableWriter(output, replace) as writer, _progress_bar(console) as progress:
        task = progress.add_task("records", total=summary.total, completed=summary.done, speed="", acceptance="")

        def show(current: batch.BatchSummary) -> None:
            progress.update(task, completed=current.done, speed=f"{current.tokens_per_second:.1f} tok/s",
                            acceptance=f"accept {_percent(current.acceptance_rate)}")

        try:
            batch.run_batch(pending, generate, writer.write, summary, model, on_record=show)
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM as `Terminated`
            progress.stop()
            error_console().print(
                f"interrupted: {summary.done} of {summary.total} records are in {output} — "
                "run the same command with --resume to finish", markup=False,
            )
            raise typer.Exit(interrupted_exit_code(interrupt)) from None
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


def _print_summary(summary: batch.BatchSummary, console: Console) -> None:
    table = Table(title="specdec run", show_header=False, title_justify="left")
    table.add_row("records", f"{summary.done} of {summary.total}"
                  + (f" ({summary.skipped} already done)" if summary.skipped else ""))
    table.add_row("failed", str(summary.failed + summary.failed_before))
    table.add_row("tokens", str(summary.completion_tokens))
    table.add_row("speed", f"{summary.tokens_per_second:.1f} tok/s over {summary.seconds:.1f} s")
    table.add_row("acceptance", _percent(summary.acceptance_rate))
    console.print(table)


def _exit_on_failures(summary: batch.BatchSummary, output: Path) -> None:
    failed = summary.failed + summary.failed_before
    if failed:
        error_console().print(
            f"{failed} of {summary.total} records failed — their lines in {output} have finish_reason "
            '"error" (or an "error" object) saying why', markup=False,
        )
        raise typer.Exit(1)
