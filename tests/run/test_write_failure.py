"""A write that fails (disk full): one line, exit 3, the records before it intact, and --resume finishes."""

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.batch import DurableWriter, writer
from specdec_cli.cli import app
from specdec_cli.errors import OutputWriteError

LINES = [{"id": f"r{i}", "prompt": f"Hello {i}"} for i in range(5)]


def disk_full_after(monkeypatch, whole_records: int) -> None:
    """The writer's low-level write succeeds `whole_records` times, then writes half a line and fails."""
    write_all, calls = writer._write_all, []

    def failing(descriptor, data):
        calls.append(data)
        if len(calls) > whole_records:
            os.write(descriptor, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(descriptor, data)

    monkeypatch.setattr(writer, "_write_all", failing)


def test_a_failed_write_leaves_only_whole_records(tmp_path, monkeypatch):
    disk_full_after(monkeypatch, 1)
    with DurableWriter(tmp_path / "out.jsonl", replace=False) as out:
        out.write({"id": 1})
        with pytest.raises(OutputWriteError, match="No space left on device"):
            out.write({"id": 2, "text": "x" * 100})
    assert (tmp_path / "out.jsonl").read_text() == '{"id": 1}\n'


@pytest.fixture
def run(tiny_pair, tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))

    def invoke(output, *args):
        arguments = ["run", str(tmp_path / "in.jsonl"), "-o", str(output), "--target", tiny_pair.target,
                     "--draft", tiny_pair.draft, "--dtype", "float32", "-n", "4", "-t", "0", *args]
        return CliRunner().invoke(app, arguments)
    return invoke


def test_disk_full_is_one_line_exit_3_and_resume_finishes_once_there_is_room(run, tmp_path, monkeypatch):
    output = tmp_path / "out.jsonl"
    disk_full_after(monkeypatch, 2)
    result = run(output)
    assert result.exit_code == 3, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines()[-1] == (
        f"error: cannot write {output}: No space left on device — the 2 of 5 records before it are intact; make room "
        "(or fix the disk) and run the same command with --resume to finish")
    assert "Traceback" not in result.output
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["r0", "r1"]
    monkeypatch.undo()
    resumed = run(output, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == [f"r{i}" for i in range(5)]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_dev_full_is_one_line(run):
    result = run("/dev/full")
    assert result.exit_code == 3, result.output
    assert result.stderr.splitlines()[-1].startswith("error: cannot write /dev/full: No space left on device — the 0 of 5")
    assert "Traceback" not in result.output
    assert not Path("/dev/full.lock").exists() and not Path("/dev/full.settings.json").exists()
