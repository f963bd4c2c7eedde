"""Command-line mistakes get Typer's usual usage message and exit code 2, before anything loads; no
traceback, no file touched. `--debug` (or SPECDEC_DEBUG=1) shows the traceback of an error it would
otherwise print as one line; a bug shows its traceback either way."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app

from tests.cli_result import assert_exited

ROOT = Path(__file__).resolve().parents[2]
WIDE = {"COLUMNS": "200"}


def usage_error(result) -> tuple[str, str]:
    """(the Usage: line, the error text) from Typer's message, the Rich box around the error undone."""
    lines = result.stderr.splitlines()
    boxed = " ".join(line.strip("│ ") for line in lines if line.startswith("│"))
    return lines[0], boxed


@pytest.mark.parametrize(
    ("args", "usage", "error"),
    [
        (["run", "in.jsonl", "-o", "out.jsonl", "--bogus"], "Usage: specdec run [OPTIONS] {INPUT}", "No such option: --bogus"),
        (["chat", "--seeed", "0"], "Usage: specdec chat [OPTIONS]", "No such option: --seeed (Possible options: --seed)"),
        (["compare", "--bogus"], "Usage: specdec compare [OPTIONS]", "No such option: --bogus"),
        (["run", "in.jsonl"], "Usage: specdec run [OPTIONS] {INPUT}", "Missing option '--output' / '-o'."),
        (["run", "in.jsonl", "-o", "out.jsonl", "--max-new-tokens", "many"], "Usage: specdec run [OPTIONS] {INPUT}",
         "Invalid value for '--max-new-tokens' / '-n': Input should be a valid integer, unable to parse string as an integer"),
        (["chat", "--temperature", "hot"], "Usage: specdec chat [OPTIONS]",
         "Invalid value for '--temperature' / '-t': Input should be a valid number, unable to parse string as a number"),
        (["compare", "--n-prompts", "two"], "Usage: specdec compare [OPTIONS]",
         "Invalid value for '--n-prompts': Input should be a valid integer, unable to parse string as an integer"),
        (["run", "in.jsonl", "-o", "out.jsonl", "--limit", "0"], "Usage: specdec run [OPTIONS] {INPUT}",
         "Invalid value for '--limit': Input should be greater than or equal to 1"),
        (["frobnicate"], "Usage: specdec [OPTIONS] COMMAND [ARGS]...", "No such command 'frobnicate'."),
    ],
)
def test_a_usage_mistake_is_typers_message_and_exit_2(tmp_path, monkeypatch, args, usage, error):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    (tmp_path / "out.jsonl").write_text('{"id": "precious"}\n')
    result = CliRunner().invoke(app, args, env=WIDE)
    assert_exited(result, 2)
    assert usage_error(result) == (usage, error)
    assert result.stdout == ""
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "precious"}\n'  # nothing lost


def specdec(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """`specdec ARGS` in a real process (this tree first on the path); `code` runs first, in that process."""
    command = [sys.executable, "-c", f"{code or ''}\nfrom specdec_cli.cli import main; main()", *args]
    environment = {key: value for key, value in os.environ.items() if key != "SPECDEC_DEBUG"}
    environment.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), COLUMNS="200")
    environment.update(env or {})
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)


def test_a_usage_mistake_in_a_real_process_prints_no_traceback():
    process = specdec("run", "in.jsonl", "--bogus")
    assert process.returncode == 2
    assert "No such option: --bogus" in process.stderr and "Traceback" not in process.stderr


def test_a_user_error_is_one_line_without_debug(tmp_path):
    process = specdec("profiles", "show", "nope", env={"SPECDEC_HOME": str(tmp_path)})
    assert process.returncode == 2
    assert process.stderr.startswith("error: unknown profile 'nope' — known profiles: ")
    assert len(process.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("debug", [["--debug"], {"SPECDEC_DEBUG": "1"}], ids=["--debug", "SPECDEC_DEBUG"])
def test_debug_shows_the_traceback_of_a_user_error(tmp_path, debug):
    flags, env = (debug, {}) if isinstance(debug, list) else ([], debug)
    process = specdec(*flags, "profiles", "show", "nope", env={"SPECDEC_HOME": str(tmp_path), **env})
    assert process.returncode == 1
    assert process.stderr.startswith("Traceback (most recent call last):")
    assert "specdec_cli/profiles.py" in process.stderr  # where it was raised
    assert process.stderr.strip().splitlines()[-1].startswith("specdec_cli.errors.ProfileError: unknown profile 'nope'")


@pytest.mark.parametrize("flags", [[], ["--debug"]])
def test_a_bug_shows_its_traceback_with_or_without_debug(tmp_path, flags):
    """An internal error is not a user mistake: never hidden behind a one-line message."""
    code = ("import specdec_cli.cli.profiles as command\n"
            "def broken(): raise RuntimeError('an internal error')\n"
            "command.scan_profiles = broken")
    process = specdec(*flags, "profiles", "list", env={"SPECDEC_HOME": str(tmp_path)}, code=code)
    assert process.returncode == 1
    assert "Traceback (most recent call last):" in process.stderr
    assert process.stderr.strip().splitlines()[-1] == "RuntimeError: an internal error"


@pytest.mark.parametrize(("args", "command", "said"), [
    ([], "chat", "accepted draft tokens, the target's corrections, bonus tokens."),
    ([], "run", "lines, OpenAI Batch API request lines, or both."),
    (["profiles"], "list", "A broken file is named on stderr (with what is wrong) after the table of the good ones,"),
])
def test_a_command_list_gives_each_description_as_one_paragraph(args, command, said):
    """Typer prints a command's docstring in its group's list with the source's line breaks: at 200 columns the
    description must run on, not break where the docstring did."""
    result = CliRunner().invoke(app, [*args, "--help"], env=WIDE)
    assert_exited(result, 0)
    line = next(line for line in result.stdout.splitlines() if line.startswith(f"│ {command} "))
    assert said in line, result.stdout
