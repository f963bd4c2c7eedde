"""Progress shown on stderr while something slow happens. The only Rich use in models/."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

from rich.console import Console


def status(message: str, enabled: bool = True) -> ContextManager[object]:
    """A Rich spinner on stderr with `message` while the block runs (nothing when disabled)."""
    if not enabled:
        return nullcontext()
    return _spinner(message)


@contextmanager
def _spinner(message: str) -> Iterator[object]:
    console = Console(stderr=True, highlight=False)
    with console.status(message) as spinner:
        yield spinner
