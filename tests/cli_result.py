"""How a CliRunner result ended. CliRunner never prints a traceback: an uncaught exception shows only as
`result.exception` (and exit code 1, the same code a command may choose), so check that instead."""


def assert_exited(result, code: int) -> None:
    """The command ended with `code` on purpose (returned, or sys.exit / typer.Exit), not by a crash."""
    assert result.exit_code == code, (result.exit_code, result.exception, result.output)
    if code == 0:
        assert result.exception is None, repr(result.exception)
    else:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
