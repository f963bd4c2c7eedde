"""One `run` per output file: an exclusive OS lock (flock) on a sibling `OUTPUT.lock`, taken before the
models load and held until the process exits, so that a second run on the same OUTPUT cannot write
duplicates into it. The lock file holds the holder's pid for the refusal message and is removed on
release; a killed run leaves the file behind but not the lock (the kernel drops it). No torch."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from specdec_cli.errors import InputError


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


class OutputLock:
    """`with OutputLock(output):` — the exclusive right to write OUTPUT; InputError when another process has it."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = lock_path(output)
        self._descriptor: int | None = None

    def __enter__(self) -> OutputLock:
        while self._descriptor is None:
            descriptor = self._open()
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(descriptor)
                os.close(descriptor)
                raise InputError(
                    f"{self.output} is being written by another specdec run ({holder}, lock {self.path})",
                    "wait for it to finish, or stop it and run again with --resume",
                ) from None
            if _same_file(descriptor, self.path):
                self._descriptor = descriptor
            else:  # its holder removed the file between our open and our lock: lock the new one
                os.close(descriptor)
        os.ftruncate(self._descriptor, 0)
        os.write(self._descriptor, f"{os.getpid()}\n".encode())
        return self

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise InputError(f"cannot create the lock file {self.path}: {error.strerror}",
                             "choose an -o in a folder you can write") from None

    def __exit__(self, *exc_info: object) -> None:
        if self._descriptor is None:
            return
        try:  # removed while still held, so that no one locks a file that is about to vanish
            self.path.unlink()
        except OSError:
            pass
        os.close(self._descriptor)
        self._descriptor = None


def _read_pid(descriptor: int) -> str:
    text = os.pread(descriptor, 32, 0).decode("ascii", errors="replace").strip()
    return f"pid {text}" if text.isdigit() else "pid unknown"


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)
