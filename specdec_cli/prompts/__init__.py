"""Prompt sets for `specdec compare`: the built-in set, or a JSONL file of one of three line kinds.

- `{"prompt": "..."}`: raw text, fed to the model as it is (a completion);
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation, through the chat template;
- Spec-Bench `{"question_id", "category", "turns": [...]}`: the first turn as a user message.

Any line may carry `"category"` (default `default`). Text only: encoding to ids happens in bench.py."""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import InputError
from specdec_cli.prompts import jsonl
from specdec_cli.prompts.jsonl import refuse_one_document, refuse_wide_encoding
from specdec_cli.prompts.builtin import BUILTIN_PROMPTS

DEFAULT_CATEGORY = "default"
LINE_KINDS = 'each line needs "prompt", "messages", or Spec-Bench "turns"'


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str | None = None  # raw completion text
    messages: tuple[dict, ...] | None = None  # a conversation for the chat template
    as_user_turn: bool = False  # `text` is one user message (chat template when the model has one)


def builtin_prompts() -> list[Prompt]:
    return [
        Prompt(id=f"builtin-{index}", category=category, text=text, as_user_turn=True)
        for index, (category, text) in enumerate(BUILTIN_PROMPTS, start=1)
    ]


def read_prompt_file(path: Path) -> list[Prompt]:
    try:
        data = path.read_bytes()
        refuse_wide_encoding(data, str(path))
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not part of line 1
    except FileNotFoundError:
        raise InputError(f"no prompt file {path}", "give an existing .jsonl file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}", "give a readable UTF-8 .jsonl file") from None
    lines = text.splitlines()
    try:
        prompts = [_parse_line(line, number, path) for number, line in enumerate(lines, start=1) if line.strip()]
    except InputError:
        refuse_one_document(text, str(path))  # says so when the file is one JSON list or indented object
        raise
    if not prompts:
        raise InputError(f"{path} holds no prompts", LINE_KINDS)
    return prompts


def _parse_line(line: str, number: int, path: Path) -> Prompt:
    where = f"line {number} of {path}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{where} is not valid JSON ({error.msg})", "write one JSON object per line") from None
    except RecursionError:
        raise InputError(f"{where} {jsonl.TOO_DEEP}", "write one flat JSON object per line") from None
    if not isinstance(record, dict):
        raise InputError(f"{where} is not a JSON object", LINE_KINDS)
    _refuse_near_miss(record, where)
    half = jsonl.lone_surrogate(record)
    if half is not None:  # the tokenizer's TypeError traceback, minutes into the benchmark
        problem, mend = jsonl.lone_surrogate_problem(*half)
        raise InputError(f"{where}: {problem}", mend)
    prompt_id = str(record.get("question_id", record.get("id", number)))
    category = str(record.get("category", DEFAULT_CATEGORY))
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        return Prompt(prompt_id, category, text=record["prompt"])
    if _is_conversation(record.get("messages")):
        return Prompt(prompt_id, category, messages=tuple(record["messages"]))
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0]:
        return Prompt(prompt_id, category, text=turns[0], as_user_turn=True)
    raise InputError(f"{where} has no usable prompt", LINE_KINDS)


KEYS = ("prompt", "messages", "turns", "category", "id", "question_id")


def _refuse_near_miss(record: dict, where: str) -> None:
    """A key one letter or two from one the line lacks ("catgory") is a typo: other keys are ignored, so that line
    went into the default category (or fell back to another key's prompt) and its table row said nothing of it."""
    for key in record:
        close = difflib.get_close_matches(key, KEYS, 1, cutoff=0.85) if key not in KEYS else []
        if close and close[0] not in record:
            raise InputError(f'{where} has "{key}": did you mean "{close[0]}"?',
                             f"rename it (a prompt file's lines take {', '.join(map(repr, KEYS))}; other keys are "
                             "ignored)")


def _is_conversation(messages: object) -> bool:
    return (
        isinstance(messages, list) and bool(messages)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    )


def select_prompts(prompts: Sequence[Prompt], categories: Sequence[str] = (), per_category: int | None = None) -> list[Prompt]:
    """The prompts of the chosen categories (all when none are named), at most `per_category` of
    each, in file order."""
    available = list(dict.fromkeys(prompt.category for prompt in prompts))
    unknown = [category for category in categories if category not in available]
    if unknown:
        raise InputError(f"no prompts in category {', '.join(map(repr, unknown))}", f"choose from: {', '.join(available)}")
    if per_category is not None and per_category < 1:
        raise InputError(f"--n-prompts must be at least 1, got {per_category}", "pass a positive number")
    wanted = set(categories) or set(available)
    taken: dict[str, int] = {}
    chosen = []
    for prompt in prompts:
        if prompt.category in wanted and (per_category is None or taken.get(prompt.category, 0) < per_category):
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            chosen.append(prompt)
    return chosen
