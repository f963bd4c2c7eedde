"""One `run` per OUTPUT: a second run on the same file is refused in one line naming the holder's pid."""

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli import batch
from specdec_cli.cli import app

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from pathlib import Path
from specdec_cli.batch import OutputLock
with OutputLock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def held(tmp_path):
    """Another process holding the lock on tmp_path/out.jsonl until the test ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out.jsonl")], env=env, cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"held\n"
    yield holder
    holder.stdin.close()
    holder.wait(timeout=30)


def run(tmp_path, *args):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    return CliRunner().invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *args])


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]])
def test_a_second_run_on_the_same_output_is_refused_naming_the_holder(tmp_path, held, flags):
    result = run(tmp_path, "--target", str(tmp_path / "absent"), *flags)  # refused before any model loads
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: {tmp_path / 'out.jsonl'} is being written by another specdec run (pid {held.pid}, lock "
        f"{tmp_path / 'out.jsonl.lock'}) — wait for it to finish, or stop it and run again with --resume\n")
    assert not (tmp_path / "out.jsonl").exists()


def test_the_lock_is_held_while_the_models_load_and_released_at_exit(tiny_pair, tmp_path, monkeypatch):
    load = batch.BatchedGeneration.load
    seen = []

    def load_while_checking(*args, **kwargs):
        descriptor = os.open(tmp_path / "out.jsonl.lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(os.pread(descriptor, 32, 0))
        finally:
            os.close(descriptor)
        return load(*args, **kwargs)

    monkeypatch.setattr(batch.BatchedGeneration, "load", load_while_checking)
    result = run(tmp_path, "--target", tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32", "-n", "4")
    assert result.exit_code == 0, result.output
    assert seen == [f"{os.getpid()}\n".encode()]
    assert not (tmp_path / "out.jsonl.lock").exists()
    assert json.loads((tmp_path / "out.jsonl").read_text())["id"] == "a"


def test_a_stale_lock_file_left_by_a_killed_run_does_not_block(tmp_path):
    (tmp_path / "out.jsonl.lock").write_text("999999\n")  # no process holds it
    with batch.OutputLock(tmp_path / "out.jsonl"):
        assert (tmp_path / "out.jsonl.lock").read_text() == f"{os.getpid()}\n"
    assert not (tmp_path / "out.jsonl.lock").exists()
