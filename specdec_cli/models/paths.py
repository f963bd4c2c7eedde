"""Where specdec keeps what it builds: SPECDEC_HOME, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; rename it into place only if the block succeeds,
    so a crash never leaves a half-written cache entry."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield staging
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


@contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Like `atomic_folder`, for one file."""
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    os.close(handle)
    staging = Path(name)
    try:
        yield staging
        staging.chmod(0o666 & ~_umask())  # mkstemp makes it private; a cache file is an ordinary file
        staging.replace(final)
    finally:
        staging.unlink(missing_ok=True)
