"""`run -o -`: the records on standard output, in input order; no file named "-", no lock, nothing to resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app

from tests.cli_result import assert_exited

ROOT = Path(__file__).resolve().parents[2]


def specdec_run(tiny_pair, tmp_path, *args, stdin=None):
    command = [sys.executable, "-m", "specdec_cli", "run", *args, "--target", tiny_pair.target, "--draft", tiny_pair.draft,
               "--dtype", "float32", "-t", "0", "-n", "4", "-q"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=tmp_path, env=env, input=stdin, capture_output=True, text=True, timeout=300)


def test_dash_writes_the_records_to_standard_output_in_input_order(tiny_pair, tmp_path):
    """`-o -` made a file named "-" in the current folder (and a "-.lock", and "-.settings.json"), and printed nothing."""
    lines = [{"id": f"r{number}", "prompt": f"Hello {number}"} for number in range(5)] + [{"id": "bad", "prompt": 3}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    process = specdec_run(tiny_pair, tmp_path, "in.jsonl", "-o", "-")
    assert process.returncode == 1, process.stderr  # the bad line's record failed
    records = [json.loads(line) for line in process.stdout.splitlines()]
    assert [record["id"] for record in records] == [line["id"] for line in lines]
    assert all(record["finish_reason"] == "length" for record in records[:5]) and records[5]["finish_reason"] == "error"
    assert "1 of 6 records failed — their lines in standard output have finish_reason" in process.stderr
    assert sorted(path.name for path in tmp_path.iterdir() if path.name != "specdec-home") == ["in.jsonl"]  # the home: the tests'

    piped = specdec_run(tiny_pair, tmp_path, "-", "-o", "-", stdin=(tmp_path / "in.jsonl").read_text())
    texts = lambda output: [(record["id"], record["text"]) for record in map(json.loads, output.splitlines())]  # noqa: E731
    assert texts(piped.stdout) == texts(process.stdout)  # greedy: the same answers, stdin to stdout (stats' times differ)


def test_dot_slash_dash_is_the_file_named_dash(tiny_pair, tmp_path):
    """`./-` is the shell's way to name a file called "-"; pathlib drops the "./", so it wrote to standard output."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    process = specdec_run(tiny_pair, tmp_path, "in.jsonl", "-o", "./-")
    assert process.returncode == 0, process.stderr
    assert process.stdout == ""
    assert [json.loads(line)["id"] for line in (tmp_path / "-").read_text().splitlines()] == ["a"]
    assert (tmp_path / "-.settings.json").is_file()  # a file of records like any other: it can be resumed
    again = specdec_run(tiny_pair, tmp_path, "in.jsonl", "-o", "./-", "--resume")
    assert again.returncode == 0, again.stderr
    assert len((tmp_path / "-").read_text().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_dash_with_resume_or_overwrite_is_a_usage_mistake(tmp_path, flag):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    result = CliRunner().invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", "-", flag, "--target", str(tmp_path / "none")])
    assert_exited(result, 2)
    assert result.stderr == (f"error: {flag} needs an OUTPUT file, and -o - writes to standard output — write to a file "
                             "with -o FILE to resume or replace it\n")


def test_a_reader_that_goes_away_stops_the_run_quietly(tiny_pair, tmp_path):
    """`run -o - | head -1`: the closed pipe was an error line telling the user to resume a file (exit 3)."""
    # more records than a pipe holds (64 KB): the writer meets the closed pipe however fast it runs
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": n, "prompt": f"Count {n}"}) + "\n" for n in range(400)))
    command = [sys.executable, "-m", "specdec_cli", "run", "in.jsonl", "-o", "-", "-b", "1", "--target", tiny_pair.target,
               "--draft", tiny_pair.draft, "--dtype", "float32", "-t", "0", "-n", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert json.loads(process.stdout.readline())["id"] == 0
    process.stdout.close()  # as head does once it has its line
    assert process.wait(timeout=300) == 141
    stderr = process.stderr.read().decode()
    assert "error" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("command", [["chat", "--no-color", "-n", "400"], ["run", "-", "-o", "-", "-b", "1", "-n", "4"]])
def test_a_closed_pipe_ends_chat_and_run_with_the_sigpipe_code_not_a_crash(tiny_pair, tmp_path, command):
    """`specdec chat | head -c 100` exited 1 (the code of a crash) with nothing said: Rich's own broken-pipe exit."""
    # More output than a pipe holds (64 KB), so the writer meets the closed pipe however fast it runs; it stops there.
    lines = "".join(json.dumps({"id": n, "prompt": f"Count {n}"}) + "\n" for n in range(400))
    stdin = lines if command[0] == "run" else "Tell me a long story\n/reset\n" * 200  # each reply from an empty context
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "specdec_cli", *command, "--target", tiny_pair.target, "--draft",
                                tiny_pair.draft, "--dtype", "float32", "-t", "0"], cwd=tmp_path, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdin.write(stdin.encode())
    process.stdin.close()
    assert process.stdout.read(20)
    process.stdout.close()
    assert process.wait(timeout=300) == 141
    stderr = process.stderr.read().decode()
    assert "error" not in stderr and "Traceback" not in stderr, stderr
