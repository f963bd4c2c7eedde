"""Where specdec keeps what it builds: SPECDEC_HOME, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ContextManager, Iterator

from specdec_cli.errors import CacheWriteError, InputError

MOVE_HOME = "free some space there, or set SPECDEC_HOME to a folder on a disk with room"
_SPARE = 64 * 1024 * 1024  # what a check for room leaves free besides (a stamp, a lock, the file system's own)


def specdec_home() -> Path:
    explicit = os.environ.get("SPECDEC_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specdec"


def cache_dir(kind: str) -> Path:
    """A sub-folder of the specdec home for one kind of cached artefact ("gguf", "demo")."""
    folder = specdec_home() / kind
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheWriteError(f"cannot make {folder}: {error.strerror}", "set SPECDEC_HOME to a folder you can write") from None
    return folder


def check_room(folder: Path, needed: int, what: str) -> None:
    """CacheWriteError, before any writing, when `folder`'s disk has less than `needed` bytes free (and a spare)."""
    free = shutil.disk_usage(folder).free
    if free < needed + _SPARE:
        raise CacheWriteError(f"{what} needs {_gigabytes(needed)} free in {folder}; its disk has {_gigabytes(free)}",
                              MOVE_HOME)


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.0f} MB"


def _full_disk(error: Exception) -> bool:
    """Whether `error` says the disk is full: an OSError's errno, or the text of a writer that wraps it
    (safetensors raises its own error with the OS's message in it)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(error) or "StorageFull" in str(error)


@contextmanager
def _whole_or_nothing(final: Path) -> Iterator[None]:
    """A full disk or a folder it may not write while writing `final` becomes one CacheWriteError naming it
    (the caller removes the partial file)."""
    try:
        yield
    except Exception as error:
        if _full_disk(error):
            raise CacheWriteError(f"the disk is full: {final.name} could not be written in {final.parent}",
                                  MOVE_HOME) from None
        if isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise CacheWriteError(f"cannot write {final.name} in {final.parent}: {error.strerror}",
                                  "set SPECDEC_HOME to a folder you can write") from None
        raise


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; rename it into place only if the block succeeds,
    so a crash never leaves a half-written cache entry. Where another process put its `final` in place
    first (a cache entry is the same whoever makes it), theirs is kept and this one dropped."""
    with _whole_or_nothing(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with _whole_or_nothing(final):
            yield staging
        try:
            staging.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def one_maker(final: Path, waiting: ContextManager[object] | None = None) -> Iterator[None]:
    """Hold the exclusive lock (flock) on `final`'s file in the home's `locks/` for the block, so that a second process
    (another chat, Ray workers on one machine) that wants the same cache entry waits for the first instead of
    making it again beside it: the demo target's conversion holds gigabytes of memory for a long while. `waiting` (a
    spinner) is shown while another process holds it. The lock file stays (out of the way of the entries);
    the kernel drops a dead holder's lock, and what a dead holder left half-made is removed. Check again for
    `final` inside the block."""
    lock = cache_dir("locks") / f"{final.parent.name}.{final.name}.lock"
    try:
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise CacheWriteError(f"cannot make {lock}: {error.strerror}", MOVE_HOME) from None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with waiting or nullcontext():
                fcntl.flock(descriptor, fcntl.LOCK_EX)
        _remove_leftovers(final)
        yield
    finally:
        os.close(descriptor)


def _remove_leftovers(final: Path) -> None:
    """Remove what a killed maker of `final` left: the staging folders and files of atomic_folder/atomic_file
    (`.NAME.xxxxxxxx` beside it), which a kill -9, the kernel's out-of-memory killer or a power cut leave behind
    (a demo target's half conversion is gigabytes). Called with `final`'s lock held, so no live process is
    writing one."""
    for leftover in final.parent.glob(f".{final.name}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


@contextmanager
def replacing(final: Path, hint: str) -> Iterator[Path]:
    """A temporary path beside a user's file `final` (a record's settings, --json, --plot) to write it whole; renamed
    over `final` if the block succeeds, removed if not (a full disk leaves no part, and an earlier `final` whole). An
    OSError in the block or the rename is one InputError: "cannot write FINAL: why", then `hint`."""
    temporary = final.with_name(f".{final.name}.tmp")
    try:
        yield temporary
        os.replace(temporary, final)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise InputError(f"cannot write {final}: {error.strerror}", hint) from None


@contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Like `atomic_folder`, for one file."""
    with _whole_or_nothing(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    os.close(handle)
    staging = Path(name)
    try:
        with _whole_or_nothing(final):
            yield staging
        staging.chmod(0o666 & ~_umask())  # mkstemp makes it private; a cache file is an ordinary file
        staging.replace(final)
    finally:
        staging.unlink(missing_ok=True)
