"""What `run` (batch/requests.py) and `compare` (prompt files) say when a file of JSON lines is one JSON document
instead. No torch, no Rich."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from specdec_cli.errors import InputError


def refuse_one_document(text: str, source: str) -> None:
    """Raise InputError when `text` (the whole file, `source` its path or `-`) parses as one JSON list, or as one
    object over several lines (json.dump, with or without indent): each of its lines would be a bad line otherwise."""
    try:
        document = json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError:
        return
    if source == "-":
        name, file, lines_file = "standard input", "FILE", "lines.jsonl"
    else:
        path = Path(source)
        lines_path = path.with_suffix(".jsonl") if path.suffix != ".jsonl" else path.with_name(f"{path.stem}-lines.jsonl")
        name, file, lines_file = source, shlex.quote(source), shlex.quote(str(lines_path))
    if isinstance(document, list):
        raise InputError(f"{name} is one JSON list of {len(document)} items, not JSON lines",
                         f"write one object per line, e.g. jq -c '.[]' {file} > {lines_file}")
    lines = text.strip().count("\n") + 1
    if isinstance(document, dict) and lines > 1:
        raise InputError(f"{name} is one JSON object over {lines} lines, not JSON lines",
                         f"write each object on one line, e.g. jq -c . {file} > {lines_file}")
