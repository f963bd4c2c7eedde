"""Command-line interface: one module per command, joined here."""

from specdec_cli.cli import compare as _compare
from specdec_cli.cli import profiles as _profiles
from specdec_cli.cli.app import app, main

app.add_typer(_profiles.app, name="profiles")
app.command("compare")(_compare.compare_command)

__all__ = ["app", "main"]
