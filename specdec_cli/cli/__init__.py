"""Command-line interface: one module per command, joined here."""

from specdec_cli.cli import calibrate as _calibrate
from specdec_cli.cli import chat as _chat
from specdec_cli.cli import compare as _compare
from specdec_cli.cli import profiles as _profiles
from specdec_cli.cli import run as _run
from specdec_cli.cli.app import app, main, one_line_descriptions

app.command("chat")(_chat.chat)
app.command("run")(_run.run_command)
app.command("compare")(_compare.compare_command)
app.command("calibrate")(_calibrate.calibrate_command)
app.add_typer(_profiles.app, name="profiles")
one_line_descriptions(app)

__all__ = ["app", "main"]
