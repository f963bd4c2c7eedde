"""A real process killed with SIGKILL in the middle of a batch, then resumed: every input line has
exactly one output record, in input order, and (greedy) the text an uninterrupted run gives; one request
at a time and 4 decoded together. SIGTERM stops it like Ctrl-C, with the hint and exit 143."""

import pytest

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 40


def start(tiny_pair, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdec_cli", "run", *args, "--target", tiny_pair.target,
               "--draft", tiny_pair.draft, "--dtype", "float32", "-t", "0", "-n", "16"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def running_with_three_records(tiny_pair, tmp_path, *args: str) -> tuple[Path, Path, subprocess.Popen]:
    """A run on RECORDS requests that has written at least 3 records and is still going."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Hello {i}"}) + "\n" for i in range(RECORDS)))
    first = start(tiny_pair, str(source), "-o", str(output), *args)
    deadline = time.monotonic() + 120
    while lines_in(output) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.poll() is None, first.stderr.read().decode()[-2000:]  # still running: the signal lands mid-batch
    return source, output, first


def resume_finishes(tiny_pair, source: Path, output: Path, *args: str) -> None:
    second = start(tiny_pair, str(source), "-o", str(output), "--resume", *args)
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr.decode()[-2000:]
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == [f"r{i}" for i in range(RECORDS)]


@pytest.mark.parametrize("batch_size", ["1", "4"])
def test_sigkill_then_resume_gives_exactly_one_record_per_line(tiny_pair, tmp_path, batch_size):
    source, output, first = running_with_three_records(tiny_pair, tmp_path, "--batch-size", batch_size)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    killed_at = lines_in(output)
    assert 3 <= killed_at < RECORDS
    with open(output, "ab") as torn:  # what a kill in the middle of a write would leave
        torn.write(b'{"id": "r')
    resume_finishes(tiny_pair, source, output, "--batch-size", batch_size)
    whole = tmp_path / "whole.jsonl"
    uninterrupted = start(tiny_pair, str(source), "-o", str(whole), "--batch-size", batch_size)
    assert uninterrupted.wait(timeout=300) == 0
    assert [json.loads(line)["text"] for line in output.read_text().splitlines()] == [
        json.loads(line)["text"] for line in whole.read_text().splitlines()]


def test_sigterm_stops_like_ctrl_c_with_the_resume_hint_and_exit_143(tiny_pair, tmp_path):
    source, output, first = running_with_three_records(tiny_pair, tmp_path)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 143, stderr.decode()[-2000:]
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("interrupted: ") and last.endswith(f"records are in {output} — run the same command with "
                                                              "--resume to finish")
    assert not (tmp_path / "out.jsonl.lock").exists()  # released on the way out
    resume_finishes(tiny_pair, source, output)
