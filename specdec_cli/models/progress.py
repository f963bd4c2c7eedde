"""Progress shown on stderr while something slow happens (the only Rich use in models/), and the
switch for the libraries' own bars (transformers' "Loading weights", hub downloads)."""

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


@contextmanager
def library_bars(enabled: bool) -> Iterator[None]:
    """transformers' and huggingface_hub's tqdm bars on (as they were) or off for the block (`-q`)."""
    if enabled:
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # the hub's bars too
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()
