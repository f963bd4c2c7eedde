"""Command-line interface: one module per command, joined here."""

from specdec_cli.cli import profiles as _profiles
from specdec_cli.cli import run as _run
from specdec_cli.cli.app import app, main

app.add_typer(_profiles.app, name="profiles")
app.command("run")(_run.run_command)

__all__ = ["app", "main"]
