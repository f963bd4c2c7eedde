"""`specdec profiles list` and `specdec profiles show NAME`."""

from __future__ import annotations

from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from specdec_cli.cli.app import report_errors
from specdec_cli.models.device import DTYPES
from specdec_cli.models.preflight import estimate_local_weight_bytes
from specdec_cli.profiles import DEFAULT_PROFILE, Profile, list_profiles, load_profile

app = typer.Typer(help="List and inspect model-pair profiles.", no_args_is_help=True)


def _quantization_label(profile: Profile) -> str:
    labels = [f"{role} {value}" for role, value in (("target", profile.target_quantization), ("draft", profile.draft_quantization)) if value]
    return ", ".join(labels) or "-"


def _estimate_gb(profile: Profile) -> str:
    """From configs already on this machine, else the profile's `weights_gb` hint; "?" when neither."""
    dtype = DTYPES.get(profile.dtype, torch.bfloat16)  # "auto" is bf16 on the machines worth estimating for
    models = [(profile.target, profile.target_quantization)]
    if profile.draft:
        models.append((profile.draft, profile.draft_quantization))
    estimates = [estimate_local_weight_bytes(spec, dtype, quantization) for spec, quantization in models]
    if all(estimate is not None for estimate in estimates):
        return f"{sum(estimates) / 1e9:.1f} GB"
    return f"~{profile.weights_gb:g} GB" if profile.weights_gb else "?"


def _draft_label(profile: Profile) -> str:
    if profile.drafter == "ngram":
        return "(n-gram)"
    return f"{profile.draft} (+ n-gram)" if profile.drafter == "cascade" else profile.draft


@app.command("list")
@report_errors
def list_command() -> None:
    """All profiles: shipped ones and those in $SPECDEC_HOME/profiles."""
    table = Table("name", "target", "draft", "quantisation", "weights (est.)")
    for column in table.columns:
        column.overflow = "fold"  # show whole model names, even in a narrow terminal
    for profile in list_profiles():
        name = f"{profile.name} (default)" if profile.name == DEFAULT_PROFILE else profile.name
        table.add_row(name, profile.target, _draft_label(profile), _quantization_label(profile), _estimate_gb(profile))
    Console(soft_wrap=True).print(table)


@app.command("show")
@report_errors
def show_command(name: Annotated[str, typer.Argument(help="Profile name, as in `specdec profiles list`.")]) -> None:
    """Every setting of one profile, and the file it comes from."""
    profile = load_profile(name)
    table = Table("setting", "value", show_header=False, box=None)
    for field, value in vars(profile).items():
        table.add_row(field, "-" if value is None else str(value))
    table.add_row("weights (est.)", _estimate_gb(profile))
    Console(soft_wrap=True).print(table)
