"""`specdec profiles list` and `specdec profiles show NAME`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from specdec_cli.cli.app import PipeConsole, error_console, report_errors
from specdec_cli.profiles import DEFAULT_PROFILE, Profile, load_profile, scan_profiles

app = typer.Typer(help="List and inspect model-pair profiles.", no_args_is_help=True)


def _quantization_label(profile: Profile) -> str:
    labels = [f"{role} {value}" for role, value in (("target", profile.target_quantization), ("draft", profile.draft_quantization)) if value]
    return ", ".join(labels) or "-"


def _estimate_bytes(profile: Profile) -> tuple[int | None, bool]:
    """(bytes, from configs on this machine) of the profile's weights: from configs already here, else its
    `weights_gb` hint (False: a hint); None when neither."""
    import torch  # here, not for --help

    from specdec_cli.models.device import DTYPES
    from specdec_cli.models.loading.preflight import estimate_local_weight_bytes

    dtype = DTYPES.get(profile.dtype, torch.bfloat16)  # "auto" is bf16 on the machines worth estimating for
    models = [(profile.target, profile.target_quantization)]
    if profile.draft:
        models.append((profile.draft, profile.draft_quantization))
    estimates = [estimate_local_weight_bytes(spec, dtype, quantization) for spec, quantization in models]
    if all(estimate is not None for estimate in estimates):
        return sum(estimates), True
    return (int(profile.weights_gb * 1e9) if profile.weights_gb else None), False


def _estimate_gb(profile: Profile) -> str:
    """The one memory figure both commands show: from configs already on this machine, else the
    profile's `weights_gb` hint (marked ~); "?" when neither."""
    size, local = _estimate_bytes(profile)
    return "?" if size is None else f"{'' if local else '~'}{size / 1e9:.1f} GB"


def _fits_here(profile: Profile) -> str:
    """Whether the profile's weights fit this machine's free memory (RAM, or the GPU's for a CUDA profile) with the
    pre-flight's margin: `yes (~X of Y GiB free)`, `no (needs ~X GiB, Y GiB free)`, or `unknown` (no estimate, or
    its device is not here)."""
    from specdec_cli.errors import SpecdecError
    from specdec_cli.models.device import available_memory_bytes, format_gib, resolve_device
    from specdec_cli.models.loading.preflight import fits

    size, _ = _estimate_bytes(profile)
    try:
        available = available_memory_bytes(resolve_device(profile.device))
    except SpecdecError:  # a profile for a device this machine lacks
        return "unknown"
    if size is None:
        return "unknown"
    if fits(size, available):
        return f"yes (~{format_gib(size)} of {format_gib(available)} free)"
    return f"no (needs ~{format_gib(size)}, {format_gib(available)} free)"


def _draft_label(profile: Profile) -> str:
    if profile.drafter == "ngram":
        return "(n-gram)"
    return f"{profile.draft} (+ n-gram)" if profile.drafter == "cascade" else profile.draft


@app.command("list")
@report_errors
def list_command() -> None:
    """All profiles: shipped ones and those in $SPECDEC_HOME/profiles. A broken file is named on stderr
    (with what is wrong) after the table of the good ones, and the exit code is 2. "fits here" says whether a
    profile's weights fit this machine's free memory."""
    profiles, problems = scan_profiles()
    table = Table("name", "target", "draft", "quantisation", "weights (est.)", "fits here")
    for column in table.columns:
        column.overflow = "fold"  # show whole model names, even in a narrow terminal
    for profile in profiles:
        name = f"{profile.name} (default)" if profile.name == DEFAULT_PROFILE else profile.name
        table.add_row(name, profile.target, _draft_label(profile), _quantization_label(profile), _estimate_gb(profile),
                      _fits_here(profile))
    PipeConsole(soft_wrap=True).print(table)
    for problem in problems:
        error_console().print(f"error: {problem.one_line()}", markup=False)
    if problems:
        raise typer.Exit(2)


@app.command("show")
@report_errors
def show_command(name: Annotated[str, typer.Argument(help="Profile name, as in `specdec profiles list`.")]) -> None:
    """Every setting of one profile, and the file it comes from."""
    profile = load_profile(name)
    table = Table("setting", "value", show_header=False, box=None)
    for field, value in vars(profile).items():
        if field != "weights_gb":  # a hint, shown through the estimate below so the two commands agree
            table.add_row(field, "-" if value is None else str(value))
    table.add_row("weights (est.)", _estimate_gb(profile))
    table.add_row("fits here", _fits_here(profile))
    PipeConsole(soft_wrap=True).print(table)
