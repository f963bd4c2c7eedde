"""`run`'s output file: refusing to clobber it, resuming it (repair a torn last line, read what is done),
and a writer that makes each record durable (flush + fsync) the moment it is written. No torch."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from specdec_cli.errors import InputError, OutputClosed, OutputWriteError


STDOUT = Path("-")  # `-o -`: the records go to standard output, in input order, as they are done


def output_name(output: Path) -> str:
    """OUTPUT in a message: its path, or "standard output"."""
    return "standard output" if output == STDOUT else str(output)


def check_output(output: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to touch an existing, non-empty OUTPUT unless told how: resuming with other settings
    would mix two runs in one file, and overwriting it silently would lose finished records."""
    if resume and overwrite:
        raise InputError("--resume and --overwrite contradict each other", "pick one")
    if output == STDOUT:
        if resume or overwrite:
            flag = "--resume" if resume else "--overwrite"
            raise InputError(f"{flag} needs an OUTPUT file, and -o - writes to standard output",
                             "write to a file with -o FILE to resume or replace it")
        return
    if output.is_dir():
        raise InputError(f"{output} is a folder", "give a file name for -o")
    if not output.parent.is_dir():
        raise InputError(f"the folder {output.parent} does not exist", "create it first, or choose another -o")
    if output.exists() and output.stat().st_size > 0 and not (resume or overwrite):
        raise InputError(
            f"{output} already exists",
            "pass --resume to continue it (same settings), or --overwrite to replace it",
        )


def read_finished(output: Path) -> list[dict]:
    """The records already in OUTPUT, after cutting off a torn last line left by a crash."""
    if not output.exists():
        return []
    with open(output, "r+b") as file:
        data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):
            file.truncate(len(complete))
            file.flush()
            os.fsync(file.fileno())
    return [_finished_record(output, number, line) for number, line in enumerate(complete.splitlines(), 1)]


def _finished_record(output: Path, number: int, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past the limit
        record = None
    if not isinstance(record, dict) or not ("id" in record or "custom_id" in record):
        raise InputError(
            f"{output} line {number} is not a specdec run record, so it cannot be resumed",
            "pass --overwrite to replace the file, or choose another -o",
        )
    return record


class DurableWriter:
    """Appends one JSON line per record; `write` returns only once the record is on disk. A write that
    fails (disk full) raises OutputWriteError after cutting the file back to its last whole record.
    For STDOUT it writes to a copy of file descriptor 1 (whatever it is: a pipe, a terminal, a redirected file)."""

    def __init__(self, output: Path, replace: bool) -> None:
        self.output = output
        if output == STDOUT:
            self._descriptor = os.dup(1)
            return
        created = not output.exists()
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_APPEND)
        try:
            self._descriptor = os.open(output, flags, 0o644)  # unbuffered: nothing left to flush when closing
        except OSError as error:
            raise InputError(f"cannot write {output}: {error.strerror}", "check the path and its permissions") from None
        if created:
            _fsync_directory(output.parent)  # the new file's name survives a crash too

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        # backslashreplace turns a lone surrogate (from a JSON "\\ud800" id) back into a JSON escape.
        data = line.encode("utf-8", errors="backslashreplace")
        size = _size(self._descriptor)
        try:
            _write_all(self._descriptor, data)
            _fsync(self._descriptor)
        except OSError as error:
            _cut_back(self._descriptor, size)
            if self.output == STDOUT and error.errno == errno.EPIPE:
                raise OutputClosed("standard output was closed", "") from None
            if self.output == STDOUT:
                raise OutputWriteError(f"cannot write to standard output: {error.strerror}",
                                       "write to a file with -o FILE, which --resume can continue") from None
            raise OutputWriteError(f"cannot write {self.output}: {error.strerror}",
                                   "make room (or fix the disk) and run the same command with --resume") from None

    def close(self) -> None:
        os.close(self._descriptor)

    def __enter__(self) -> "DurableWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view):]


def _size(descriptor: int) -> int | None:
    status = os.fstat(descriptor)
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _fsync(descriptor: int) -> None:
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno != errno.EINVAL:  # EINVAL: a device or pipe (/dev/null) that has nothing to sync
            raise


def _cut_back(descriptor: int, size: int | None) -> None:
    """Drop a partly written line, so that the file ends with a whole record (best effort: --resume repairs it too)."""
    if size is None:
        return
    try:
        os.ftruncate(descriptor, size)
    except OSError:
        pass


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
