"""Reading styles back from what a Rich console wrote: runs of (SGR codes, text)."""

from __future__ import annotations

import re

from rich.console import Console

_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def terminal() -> Console:
    """A recording console that behaves like a colour terminal."""
    return Console(record=True, force_terminal=True, color_system="truecolor", width=200, soft_wrap=True)


def styled_runs(ansi: str) -> list[tuple[str, str]]:
    """[(sgr codes in force, text)] for each stretch of text; "" = no style."""
    runs, codes, position = [], "", 0
    for match in _SGR.finditer(ansi):
        if match.start() > position:
            runs.append((codes, ansi[position:match.start()]))
        codes = "" if match.group(1) in ("", "0") else match.group(1)
        position = match.end()
    if position < len(ansi):
        runs.append((codes, ansi[position:]))
    return runs
