"""The Typer application, the global flags, and the one place where user-facing errors are printed."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Iterator
from typing import Annotated, Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from specdec_cli import __version__
from specdec_cli.errors import SpecdecError

app = typer.Typer(
    name="specdec",
    help="Faster local LLM chat and batch generation with lossless speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)

_state = {"debug": bool(os.environ.get("SPECDEC_DEBUG"))}

F = TypeVar("F", bound=Callable[..., object])


PIPE_CLOSED = 128 + 13  # the shell's code for a writer stopped by SIGPIPE (`specdec chat | head` once head is done)


class PipeConsole(Console):
    """A Rich console whose reader going away (`| head`) ends the command with the shell's SIGPIPE code: Rich's own
    exits 1, the code of a crash, with nothing said."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (sys.stderr if self.stderr else sys.stdout).fileno())
        raise SystemExit(PIPE_CLOSED)


def error_console() -> Console:
    # Built per call so that tests capturing stderr (CliRunner) see what is printed.
    return PipeConsole(stderr=True, highlight=False, soft_wrap=True)


def report_errors(command: F) -> F:
    """Wrap a command: a SpecdecError becomes one line on stderr and exit code 2; Ctrl-C exits 130
    (SIGTERM 143, where the command turned it into `Terminated`)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SpecdecError as error:
            if _state["debug"]:
                raise
            # escape: hints like `pip install 'specdec[demo]'` hold brackets that Rich would read as markup
            error_console().print(f"[bold red]error:[/] {escape(error.one_line())}", markup=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt as interrupt:
            if _state["debug"]:
                raise
            error_console().print("interrupted")
            raise typer.Exit(interrupted_exit_code(interrupt)) from None

    return wrapper  # type: ignore[return-value]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is so that it stops as after Ctrl-C (and says how to go on)."""


def interrupted_exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's code for the signal: 128 + SIGTERM (15) or 128 + SIGINT (2)."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` (a KeyboardInterrupt) instead of killing the process."""
    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: leave SIGTERM as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line_descriptions(typer_app: typer.Typer) -> None:
    """Each command's line in its group's command list: the docstring as one paragraph. Typer prints the
    docstring there with its line breaks, so the list broke each description where the source did."""
    for info in typer_app.registered_commands:
        if info.short_help is None and info.callback is not None:
            info.short_help = " ".join((info.callback.__doc__ or "").split())
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            one_line_descriptions(group.typer_instance)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"specdec {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")] = False,
) -> None:
    """Speculative decoding for local models: a small draft model (or an n-gram drafter) guesses,
    the target model verifies several tokens in one forward pass, and the output is exactly what the
    target alone would produce."""
    _state["debug"] = debug or _state["debug"]


def main() -> None:
    _tolerant_terminal()
    app(prog_name="specdec")


def _tolerant_terminal() -> None:
    """A terminal whose encoding lacks a character specdec or a model prints (an ASCII or Latin-1 locale; "·", "—",
    an emoji in a reply) raised UnicodeEncodeError mid-chat: such characters print as "?" there instead."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower().replace("-", "") != "utf8":
            stream.reconfigure(errors="replace")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
