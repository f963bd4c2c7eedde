"""What `run` (batch/requests.py) and `compare` (prompt files) say when a file of JSON lines is one JSON document
instead, or UTF-16 or UTF-32 text, or a line holds half a character. No torch, no Rich."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

from specdec_cli.errors import InputError


def refuse_one_document(text: str, source: str) -> None:
    """Raise InputError when `text` (the whole file, `source` its path or `-`) parses as one JSON list, or as one
    object over several lines (json.dump, with or without indent): each of its lines would be a bad line otherwise."""
    try:
        document = json.loads(text.removeprefix("\ufeff"))
    except (json.JSONDecodeError, RecursionError):
        return
    name, file, lines_file = _shown(source, lambda path: path.with_suffix(".jsonl") if path.suffix != ".jsonl"
                                    else path.with_name(f"{path.stem}-lines.jsonl"), "lines.jsonl")
    if isinstance(document, list):
        raise InputError(f"{name} is one JSON list of {len(document)} items, not JSON lines",
                         f"write one object per line, e.g. jq -c '.[]' {file} > {lines_file}")
    lines = text.strip().count("\n") + 1
    if isinstance(document, dict) and lines > 1:
        raise InputError(f"{name} is one JSON object over {lines} lines, not JSON lines",
                         f"write each object on one line, e.g. jq -c . {file} > {lines_file}")


# Byte-order marks of the encodings a Windows tool writes where UTF-8 was meant (Windows PowerShell 5's `>` and
# Out-File write UTF-16 LE), longest first: UTF-32 LE's begins with UTF-16 LE's.
WIDE_MARKS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))


def refuse_wide_encoding(data: bytes, source: str) -> None:
    """Raise InputError when `data` (the file's first bytes at least) starts with a UTF-16 or UTF-32 byte-order mark:
    every line of such a file failed alone as "not UTF-8", and its NUL bytes split it into lines that are not there."""
    encoding = next((name for mark, name in WIDE_MARKS if data.startswith(mark)), None)
    if encoding is None:
        return
    name, file, utf8_file = _shown(source, lambda path: path.with_name(f"{path.stem}-utf8.jsonl"), "FILE-utf8.jsonl")
    raise InputError(f"{name} is {encoding} text, not UTF-8",
                     f"save it as UTF-8 (PowerShell: Out-File -Encoding utf8), or convert it: iconv -f {encoding} -t "
                     f"UTF-8 {file} > {utf8_file}")


def _shown(source: str, fixed: Callable[[Path], Path], fixed_from_stdin: str) -> tuple[str, str, str]:
    """(`source` in a message, `source` in a shell line, the fixed file's name in that line) for a path, or for
    standard input (`-`): both quoted for the shell, so a name with a space stays one word."""
    if source == "-":
        return "standard input", "FILE", fixed_from_stdin
    return source, shlex.quote(source), shlex.quote(str(fixed(Path(source))))


def lone_surrogate(value: object, where: str = "") -> tuple[str, str] | None:
    """(where, the character) of the first lone UTF-16 surrogate in a parsed JSON value: JSON's "\\ud83d" alone, which
    json.loads keeps as a character that is none (a pair becomes the character it encodes). `where` is its path,
    messages[0].content; None where there is none. A walk without recursion: the value may nest as deep as json.loads
    took, at a deeper place in the stack."""
    waiting = [(where, value)]
    while waiting:
        where, value = waiting.pop()
        if isinstance(value, str):
            odd = next((character for character in value if "\ud800" <= character <= "\udfff"), None)
            if odd is not None:
                return where, odd
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):  # in the order the line has them
            waiting.append((f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key, item))
            if isinstance(key, str):
                waiting.append(("a key", key))
    return None


def lone_surrogate_problem(where: str, character: str) -> tuple[str, str]:
    """(the line's problem, what to do) for a lone surrogate `lone_surrogate` found: in a prompt it stopped the whole
    batch with the tokenizer's TypeError traceback; in metadata the record could not be written as UTF-8."""
    named = f'"{where}"' if where.isidentifier() else where  # a top-level key, as the other problems name it
    return (f"{named} holds \\u{ord(character):04x} alone, half of a UTF-16 character (as text cut inside an emoji by "
            "a UTF-16 substring leaves it), which no tokenizer or UTF-8 file takes", "mend the text where it was cut")


TOO_DEEP = "is nested too deeply to read (lists or objects inside each other past Python's recursion limit)"
