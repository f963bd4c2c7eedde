"""`specdec calibrate`: time forwards of 1-16 new tokens for each model of a profile in each quantisation
format on this machine, print them, and store them under the specdec home (what `auto` formats and the
README's forward-cost tables read). The measuring is `specdec_cli.models.calibrate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from specdec_cli.cli.app import PipeConsole, error_console, report_errors
from specdec_cli.cli.options import DtypeOption, ProfileOption
from specdec_cli.cli.paths import check_result_path, json_object
from specdec_cli.errors import InputError, MissingExtraError, ModelLoadError
from specdec_cli.profiles import DEFAULT_PROFILE, load_profile

DEFAULT_FORMATS = "none,int8,int4,q4"
FormatsOption = Annotated[str, typer.Option(help="Comma-separated formats: none, int8, int4, q4, nf4, bnb8.")]


def _formats(value: str, flag: str) -> list[str]:
    from specdec_cli.models.formats.quant import canonical  # torch: imported when the command runs, not for --help

    names = [name.strip() for name in value.split(",") if name.strip()]
    for name in names:
        if name == "auto":
            raise InputError(f"{flag} cannot hold auto", "name the formats to measure, e.g. none,int8,int4")
        canonical(name)  # an unknown name: one line listing the formats
    return names


def _available(names: list[str], asked: bool) -> list[str]:
    """The formats this machine can run. One named on the command line that cannot run is an error (one line,
    what to install or use instead); one of the default list is skipped with a note."""
    import torch

    from specdec_cli.models.formats.quant import check_quantization

    kept = []
    for name in names:
        try:
            check_quantization(name, torch.device("cpu"))
        except (MissingExtraError, ModelLoadError) as error:
            if asked:
                raise
            error_console().print(f"note: {name} skipped: {error.one_line()}", markup=False)
            continue
        kept.append(name)
    return kept


def _cells(seconds: dict[str, float]) -> list[str]:
    one = seconds["1"]
    return [f"{1000 * s:.0f} ms" + ("" if n == "1" else f" ×{s / one:.2f}") for n, s in seconds.items()]


def _is_result(path: Path) -> bool:
    """Whether `path` holds what `calibrate --json` writes (a machine and its timed entries)."""
    found = json_object(path)
    return found is not None and {"machine", "entries"} <= found.keys()


def _refuse_a_busy_machine() -> None:
    """Timings taken beside another job (a `specdec run` in another terminal) measure it too, and `auto` and the
    draft policy would read them as this machine's costs until the next calibration."""
    import os

    from specdec_cli.models.device import busy_cores, others_cpu_use

    used = others_cpu_use()
    if used is not None and used >= busy_cores():
        raise InputError(f"other processes are using {used:.1f} of this machine's {os.cpu_count()} cores: timings "
                         "taken now would measure them too",
                         "let them finish (or stop them) and calibrate again; --allow-busy calibrates anyway")


@report_errors
def calibrate_command(
    profile: ProfileOption = None,
    target_formats: Annotated[str, typer.Option("--target-formats", help="Formats to time the target in (comma-separated: none, int8, int4, q4, nf4, bnb8).")] = DEFAULT_FORMATS,
    draft_formats: Annotated[str, typer.Option("--draft-formats", help="Formats to time the draft in.")] = DEFAULT_FORMATS,
    dtype: DtypeOption = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed forwards per size (the median is kept).")] = 5,
    context: Annotated[int, typer.Option("--context", min=1, help="Tokens already in the cache.")] = 200,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result to this file.")] = None,
    allow_busy: Annotated[bool, typer.Option("--allow-busy", help="Time and store even while other processes use "
                                             "the CPU (their load is then part of every figure stored).")] = False,
) -> None:
    """Measure what a forward of 1, 2, 4, 8 and 16 new tokens costs for each model of a profile in each
    quantisation format on this machine. Speculation pays while verifying k tokens costs about what one
    does; which format keeps that flat depends on the CPU. Stored under the specdec home."""
    from specdec_cli.bench.measure import write_json
    from specdec_cli.models.calibrate import TOKEN_COUNTS, measure_forward_costs
    from specdec_cli.models.device import BackgroundLoad, busy_cores
    from specdec_cli.models.formats.calibration import load_calibration, machine, merged_with, save_calibration
    from specdec_cli.models.loading.prefill import GAIN

    chosen = load_profile(profile or DEFAULT_PROFILE)
    formats = {"target": _formats(target_formats, "--target-formats"), "draft": _formats(draft_formats, "--draft-formats")}
    formats = {role: _available(names, given != DEFAULT_FORMATS)
               for (role, names), given in zip(formats.items(), (target_formats, draft_formats))}
    if json_path is not None:  # before minutes of timing: a missing folder cost them all (nothing stored)
        check_result_path(json_path, "--json", "calibrate", _is_result)
    if not allow_busy:
        _refuse_a_busy_machine()
    models = {"target": chosen.target, **({"draft": chosen.draft} if chosen.draft else {})}
    facts = machine()
    console = PipeConsole(highlight=False)
    console.print(f"{facts['cpu']} · {' '.join(facts['cpu_flags']) or 'no AVX-512/AMX'} · {facts['threads']} threads · "
                  f"int8 on {facts['int8_kernel']} · {context}-token cache, median of {repeats}", markup=False)
    table = Table("model", "precision", *(f"n={n}" for n in TOKEN_COUNTS), title="forward costs (ratio to n=1)")

    def show(entry: dict) -> None:
        error_console().print(f"measured {entry['role']} · {entry['precision']}", markup=False)

    background = BackgroundLoad().begin()
    result = measure_forward_costs(models, formats, dtype=dtype or chosen.dtype, context_tokens=context,
                                   repeats=repeats, on_result=show, progress=True)
    others = background.cores()
    for entry in result["entries"]:  # the final figures: formats close enough to rank were timed again, together
        table.add_row(f"{entry['role']} {entry['model']}", entry["precision"], *_cells(entry["seconds"]))
    console.print(table)
    for role in models:
        together = next((entry["timed_with"] for entry in result["entries"]
                         if entry["role"] == role and "timed_with" in entry), None)
        if together:
            console.print(f"{role}: {', '.join(together)} were close, so they were timed again in turn; "
                          "their rows are those figures", markup=False)
    if (pairs := result.get("q4_pairs")) is not None:
        both = " · ".join(f"{n}: {1000 * pairs['seconds']['pairs'][n]:.1f} / {1000 * single:.1f} ms"
                          for n, single in pairs["seconds"]["single"].items())
        taken = (f"two at a time up to {pairs['up_to_tokens']} tokens" if pairs["up_to_tokens"]
                 else "one at a time (two at a time was not faster here)")
        console.print(f"q4 matmul: weight blocks {taken}; {pairs['model']} with / without pairs, new tokens: {both}",
                      markup=False)
    for read in result["prompt_reads"]:
        console.print(f"target {read['model']} · {read['quantization']}: a {read['tokens']}-token prompt read in "
                      f"{read['model_seconds']:.2f} s, in bfloat16 (--prefill) in {read['copy_seconds']:.2f} s "
                      f"(--prefill auto reads that way where it is {GAIN}x as fast)", markup=False)
    if others is not None and others >= busy_cores() and not allow_busy:
        raise InputError(f"other processes used {others:.1f} cores on average while this timed: the figures above "
                         "include them, so they were not stored",
                         "calibrate again on an idle machine; --allow-busy stores them anyway")
    stored, kept = merged_with(load_calibration(), result)
    if kept:
        earlier = ", ".join(f"{entry['role']} {entry['quantization']}" for entry in kept)
        error_console().print(f"kept from the calibration before (not timed again now): {earlier}", markup=False)
    if json_path is not None:  # first: what the user asked for by name (a full disk then stops before the home's)
        write_json(json_path, result)
    error_console().print(f"wrote {save_calibration(stored)}", markup=False)
