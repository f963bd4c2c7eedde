"""Files a command writes its results to (--json, --plot), checked before minutes of measuring, not after: a file
name in a folder that exists and takes new files, which replaces no file but an earlier result of its own kind."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from specdec_cli.errors import InputError


def check_result_path(path: Path, flag: str, kind: str | None = None,
                      is_result: Callable[[Path], bool] | None = None) -> None:
    """InputError where `flag`'s `path` cannot take the result; with `is_result`, also where it holds a file that is
    not a specdec `kind` result (a typo's other file, which the result would replace)."""
    if path.is_dir():
        raise InputError(f"{path} is a folder", f"give {flag} a file name")
    if is_result is not None and path.exists() and not is_result(path):
        raise InputError(f"{path} exists and is not a specdec {kind} result: {flag} would replace it",
                         f"give {flag} a new file name, or remove that file first")
    if not path.parent.is_dir():
        raise InputError(f"no folder {path.parent} for {flag}", "create it or choose another path")
    try:  # the files are written as a temporary file renamed over the path: the folder must take new files
        descriptor, probe = tempfile.mkstemp(dir=path.parent, prefix=".specdec-probe-")
    except OSError as error:
        raise InputError(f"cannot write in {path.parent} for {flag}: {error.strerror}", "choose another path") from None
    os.close(descriptor)
    os.unlink(probe)


def json_object(path: Path) -> dict | None:
    """The JSON object `path` holds; None where it holds something else or cannot be read (for the `is_result`s)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None
