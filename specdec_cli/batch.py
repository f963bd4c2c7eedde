"""Batch generation for `specdec run`: JSONL requests in, one JSONL record per request out, in order.

Four parts, each usable on its own:
  - reading   — an input line → a `Request` (either input shape), or a request that carries the
                reason it cannot run; problems never stop the batch;
  - records   — a finished request → its output record (specdec's shape or the OpenAI batch output
                shape), or an error record naming the problem;
  - the file  — resuming (repair a torn last line, count what is done) and a writer that makes each
                record durable (flush + fsync) before the next request starts;
  - the loop  — `run_batch`, which takes the generation as a callable so it can be tested without a
                model; `ModelGeneration` is the callable that runs the real decoder.

Reading, records and the file know nothing of torch or Rich."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from specdec_cli.errors import InputError, SpecdecError

if TYPE_CHECKING:
    from specdec_cli.cli.options import DecodingSettings
    from specdec_cli.engine import SpeculativeDecoder

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
OPENAI_KEYS = ("custom_id", "method", "url", "body")
MAX_SEED = 2**64 - 1  # torch's manual_seed accepts up to this


# ---- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One input line. Sampling fields left as None take the command's settings."""

    line: int
    id: str | int  # "id" (or "custom_id" on an OpenAI line); the line number when absent
    openai: bool  # an OpenAI Batch API request line: answered in the OpenAI batch output shape
    chat: bool = False  # messages through the chat template, else a raw prompt
    prompt: str | None = None
    messages: tuple[dict, ...] = ()
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    error: str | None = None  # why this line cannot run; it becomes an error record

    @property
    def key(self) -> str:
        """What resume matches output records on: the id as JSON, so 7 and "7" stay apart."""
        return json.dumps(self.id)


class BadRecord(ValueError):
    """What is wrong with one input line; it becomes that line's error record."""


def read_requests(lines: Iterable[bytes]) -> list[Request]:
    """Every non-blank line as a request, numbered from 1; a later duplicate id becomes an error."""
    requests: list[Request] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            request = parse_line(number, raw)
            if request.key in first_line and request.error is None:
                request = _failed(request, f"duplicate id {request.id!r} (first on line {first_line[request.key]})")
            first_line.setdefault(request.key, number)
            requests.append(request)
    return requests


def parse_line(number: int, raw: bytes) -> Request:
    try:
        value = json.loads(_decode(number, raw))
        if not isinstance(value, dict):
            raise BadRecord(f"expected a JSON object, got {_json_type(value)}")
    except (BadRecord, json.JSONDecodeError) as error:
        return Request(number, number, openai=False, error=f"line {number}: {_problem(error)}")
    openai = any(key in value for key in OPENAI_KEYS)
    try:
        record_id = _record_id(value, "custom_id" if openai else "id", number)
    except BadRecord as error:
        return Request(number, number, openai, error=f"line {number}: {error}")
    try:
        fields = _openai_fields(value) if openai else _plain_fields(value)
    except BadRecord as error:
        return Request(number, record_id, openai, error=f"line {number}: {error}")
    return Request(number, record_id, openai, **fields)


def _decode(number: int, raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRecord(f"not UTF-8 (byte {error.start + 1})") from None
    return text.removeprefix("\ufeff") if number == 1 else text


def _problem(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error.msg} at column {error.colno})"
    return str(error)


def _failed(request: Request, problem: str) -> Request:
    return Request(request.line, request.id, request.openai, error=f"line {request.line}: {problem}")


def _json_type(value: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _record_id(value: dict, key: str, number: int) -> str | int:
    record_id = value.get(key)
    if record_id is None:
        return number
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
        raise BadRecord(f'"{key}" must be a string or an integer, got {_json_type(record_id)}')
    return record_id


def _plain_fields(value: dict) -> dict:
    prompt, messages = value.get("prompt"), value.get("messages")
    if prompt is None and messages is None:
        raise BadRecord('no "prompt" or "messages"')
    if prompt is not None and messages is not None:
        raise BadRecord('both "prompt" and "messages": give one')
    return {**_input_fields(prompt, messages), **_sampling_fields(value, value.get("max_new_tokens"), "max_new_tokens")}


def _openai_fields(value: dict) -> dict:
    method, url, body = value.get("method"), value.get("url"), value.get("body")
    if method != "POST":
        raise BadRecord(f'unsupported method {method!r}: OpenAI batch lines use "POST"')
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BadRecord(f"unsupported url {url!r}: use {CHAT_URL} or {COMPLETIONS_URL}")
    if not isinstance(body, dict):
        raise BadRecord(f'"body" must be an object, got {_json_type(body)}')
    if body.get("n") not in (None, 1):
        raise BadRecord(f'"n" must be 1 (one completion per request), got {body.get("n")!r}')
    wanted, other = ("messages", "prompt") if url == CHAT_URL else ("prompt", "messages")
    if body.get(wanted) is None:
        raise BadRecord(f'{url} needs "{wanted}" in "body"' + (f', not "{other}"' if other in body else ""))
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    inputs = _input_fields(body.get("prompt"), None) if wanted == "prompt" else _input_fields(None, body["messages"])
    return {**inputs, **_sampling_fields(body, body.get(max_key), max_key)}


def _input_fields(prompt: object, messages: object) -> dict:
    if messages is not None:
        return {"chat": True, "messages": _messages(messages)}
    if not isinstance(prompt, str):
        raise BadRecord(f'"prompt" must be a string, got {_json_type(prompt)}')
    if not prompt:
        raise BadRecord('"prompt" is empty')
    return {"chat": False, "prompt": prompt}


def _messages(messages: object) -> tuple[dict, ...]:
    if not isinstance(messages, list):
        raise BadRecord(f'"messages" must be a list of {{"role", "content"}} objects, got {_json_type(messages)}')
    if not messages:
        raise BadRecord('"messages" is empty')
    return tuple(_message(index, message) for index, message in enumerate(messages))


def _message(index: int, message: object) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRecord(f'messages[{index}] must be an object with a "role" string')
    content = message.get("content")
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        content = "".join(part["text"] for part in content)  # OpenAI's [{"type": "text", "text": ...}]
    if not isinstance(content, str):
        raise BadRecord(f'messages[{index}].content must be a string or a list of text parts, got {_json_type(content)}')
    return {"role": message["role"], "content": content}


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _sampling_fields(value: dict, max_tokens: object, max_key: str) -> dict:
    """The optional per-request settings; null means unset, like a missing key."""
    return {
        "max_new_tokens": _optional(max_tokens, lambda v: _integer(max_key, v, 1)),
        "temperature": _optional(value.get("temperature"), lambda v: _number("temperature", v, 0.0, None)),
        "top_p": _optional(value.get("top_p"), lambda v: _number("top_p", v, 0.0, 1.0, open_low=True)),
        "top_k": _optional(value.get("top_k"), lambda v: _integer("top_k", v, 0)),
        "seed": _optional(value.get("seed"), lambda v: _integer("seed", v, 0, MAX_SEED)),
        "stop": _stop(value.get("stop")),
    }


def _optional(value: object, check: Callable[[object], object]) -> object:
    return None if value is None else check(value)


def _integer(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRecord(f'"{name}" must be an integer, got {_json_type(value)}')
    if value < low or (high is not None and value > high):
        raise BadRecord(f'"{name}" must be at least {low}' + (f" and at most {high}" if high else "") + f", got {value}")
    return value


def _number(name: str, value: object, low: float, high: float | None, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(f'"{name}" must be a number, got {_json_type(value)}')
    if not math.isfinite(value):  # json reads NaN, Infinity and -Infinity
        raise BadRecord(f'"{name}" must be a finite number, got {value}')
    if value < low or (open_low and value == low) or (high is not None and value > high):
        bounds = f"in ({low:g}, {high:g}]" if open_low else f"at least {low:g}"
        raise BadRecord(f'"{name}" must be {bounds}, got {value}')
    return float(value)


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(each, str) for each in stops):
        raise BadRecord(f'"stop" must be a string or a list of strings, got {_json_type(stop)}')
    if "" in stops:
        raise BadRecord('"stop" holds an empty string')
    return tuple(stops)


# ---- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """What generating one request produced (no timings: the loop measures wall time)."""

    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    steps: int
    drafted: int
    accepted: int


def success_record(request: Request, completion: Completion, seconds: float, model: str) -> dict:
    if request.openai:
        return _openai_success(request, completion, seconds, model)
    return {
        "id": request.id,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "stats": record_stats(completion, seconds),
        "error": None,
    }


def error_record(request: Request, message: str, code: str = "invalid_request") -> dict:
    if request.openai:
        return {**_openai_ids(request), "response": None, "error": {"code": code, "message": message}}
    return {
        "id": request.id,
        "text": None,
        "finish_reason": "error",
        "prompt_tokens": None,
        "completion_tokens": None,
        "stats": None,
        "error": message,
    }


def record_stats(completion: Completion, seconds: float) -> dict:
    """The record's speculative stats; `seconds` is wall time (encode + generate + decode)."""
    drafted, steps = completion.drafted, completion.steps
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": completion.accepted,
        "acceptance_rate": round(completion.accepted / drafted, 4) if drafted else None,
        "tokens_per_step": round(completion.completion_tokens / steps, 4) if steps else 0.0,
        "tokens_per_second": round(completion.completion_tokens / seconds, 2) if seconds > 0 else 0.0,
        "seconds": round(seconds, 4),
    }


def _openai_ids(request: Request) -> dict:
    # Derived from the line, not random: the same input gives the same output file.
    return {"id": f"batch_req_{request.line}", "custom_id": request.id}


def _openai_success(request: Request, completion: Completion, seconds: float, model: str) -> dict:
    if request.chat:
        kind, choice = "chat.completion", {"message": {"role": "assistant", "content": completion.text}}
    else:
        kind, choice = "text_completion", {"text": completion.text}
    body = {
        "id": f"{'chatcmpl' if request.chat else 'cmpl'}-{request.line}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": completion.finish_reason}],
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        },
    }
    return {
        **_openai_ids(request),
        "response": {"status_code": 200, "request_id": f"req_{request.line}", "body": body},
        "error": None,
        "specdec": record_stats(completion, seconds),
    }


def record_key(record: dict) -> str:
    """The key `Request.key` gives the request this output record answers."""
    return json.dumps(record["custom_id"] if "custom_id" in record else record["id"])


def record_failed(record: dict) -> bool:
    return record.get("finish_reason") == "error" or bool(record.get("error"))


# ---- the output file --------------------------------------------------------------------------


def check_output(output: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to touch an existing, non-empty OUTPUT unless told how: resuming with other settings
    would mix two runs in one file, and overwriting it silently would lose finished records."""
    if resume and overwrite:
        raise InputError("--resume and --overwrite contradict each other", "pick one")
    if output.is_dir():
        raise InputError(f"{output} is a folder", "give a file name for -o")
    if not output.parent.is_dir():
        raise InputError(f"the folder {output.parent} does not exist", "create it first, or choose another -o")
    if output.exists() and output.stat().st_size > 0 and not (resume or overwrite):
        raise InputError(
            f"{output} already exists",
            "pass --resume to continue it (same settings), or --overwrite to replace it",
        )


def read_finished(output: Path) -> list[dict]:
    """The records already in OUTPUT, after cutting off a torn last line left by a crash."""
    if not output.exists():
        return []
    with open(output, "r+b") as file:
        data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):
            file.truncate(len(complete))
            file.flush()
            os.fsync(file.fileno())
    return [_finished_record(output, number, line) for number, line in enumerate(complete.splitlines(), 1)]


def _finished_record(output: Path, number: int, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict) or not ("id" in record or "custom_id" in record):
        raise InputError(
            f"{output} line {number} is not a specdec run record, so it cannot be resumed",
            "pass --overwrite to replace the file, or choose another -o",
        )
    return record


class DurableWriter:
    """Appends one JSON line per record; `write` returns only once the record is on disk."""

    def __init__(self, output: Path, replace: bool) -> None:
        created = not output.exists()
        try:
            self._file: BinaryIO = open(output, "wb" if replace else "ab")
        except OSError as error:
            raise InputError(f"cannot write {output}: {error.strerror}", "check the path and its permissions") from None
        if created:
            _fsync_directory(output.parent)  # the new file's name survives a crash too

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        # backslashreplace turns a lone surrogate (from a JSON "\\ud800" id) back into a JSON escape.
        self._file.write(line.encode("utf-8", errors="backslashreplace"))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "DurableWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ---- the loop ---------------------------------------------------------------------------------


Generate = Callable[[Request], Completion]


@dataclass
class BatchSummary:
    """Counts for the progress bar and the closing table."""

    total: int = 0  # input records (after --limit)
    skipped: int = 0  # already in OUTPUT (--resume)
    written: int = 0
    failed: int = 0  # error records written by this run
    failed_before: int = 0  # error records already in OUTPUT
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    durations: list[float] = field(default_factory=list, repr=False)

    @property
    def done(self) -> int:
        return self.skipped + self.written

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def add(self, completion: Completion | None, seconds: float) -> None:
        self.written += 1
        self.seconds += seconds
        if completion is None:
            self.failed += 1
            return
        self.completion_tokens += completion.completion_tokens
        self.drafted += completion.drafted
        self.accepted += completion.accepted


def pending_requests(requests: Sequence[Request], finished: Sequence[dict]) -> list[Request]:
    """The requests OUTPUT does not answer yet. Matching counts occurrences of each key, so a
    duplicate id's error record is written exactly once too."""
    answered = Counter(record_key(record) for record in finished)
    pending = []
    for request in requests:
        if answered[request.key] > 0:
            answered[request.key] -= 1
        else:
            pending.append(request)
    return pending


def answer(request: Request, generate: Generate, model: str) -> tuple[dict, Completion | None, float]:
    """The output record for one request, the completion (None on error) and its wall time. A
    SpecdecError from generation becomes an error record; any other exception is a bug and propagates."""
    started = time.perf_counter()
    if request.error is not None:
        return error_record(request, request.error), None, 0.0
    try:
        completion = generate(request)
    except SpecdecError as error:
        message = f"line {request.line}: {error.one_line()}"
        return error_record(request, message, "generation_failed"), None, time.perf_counter() - started
    seconds = time.perf_counter() - started
    return success_record(request, completion, seconds, model), completion, seconds


def run_batch(
    requests: Sequence[Request],
    generate: Generate,
    write: Callable[[dict], None],
    summary: BatchSummary,
    model: str = "",
    on_record: Callable[[BatchSummary], None] | None = None,
) -> BatchSummary:
    """Answer each request in order, writing each record before the next request starts."""
    for request in requests:
        record, completion, seconds = answer(request, generate, model)
        write(record)
        summary.add(completion, seconds)
        if on_record is not None:
            on_record(summary)
    return summary


def read_input(source: str) -> list[bytes]:
    """The lines of INPUT (`-`: stdin), as bytes: a line that is not UTF-8 fails alone."""
    if source == "-":
        return sys.stdin.buffer.read().splitlines()
    try:
        return Path(source).read_bytes().splitlines()
    except OSError as error:
        raise InputError(f"cannot read {source}: {error.strerror}", "check the input path") from None


# ---- generation on the loaded models ----------------------------------------------------------


class ModelGeneration:
    """A `Generate` that runs one request through the speculative decoder."""

    def __init__(self, tokenizer, decoder: "SpeculativeDecoder", settings: "DecodingSettings") -> None:
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.settings = settings

    def __call__(self, request: Request) -> Completion:
        from specdec_cli import session  # imported here: reading and writing records needs no torch

        settings = self.settings
        prompt_ids = self._encode(request)
        params = session.sampling_params(
            _given(request.temperature, settings.temperature),
            _given(request.top_p, settings.top_p),
            _given(request.top_k, settings.top_k),
            _given(request.seed, settings.seed),
        )
        stops = session.StopStrings(self.tokenizer, request.stop)
        # Each request starts from nothing (no cache, no learned draft length), so its output
        # depends on it alone: resuming, --limit or reordering the file never changes a record.
        self.decoder.reset()
        max_new_tokens = _given(request.max_new_tokens, settings.max_new_tokens)
        result = self.decoder.generate(prompt_ids, params, max_new_tokens, stop=stops if stops.stops else None)
        text = stops.cut(self.tokenizer.decode(result.tokens, skip_special_tokens=True))
        stats = result.stats
        return Completion(
            text, result.finish_reason, len(prompt_ids), len(result.tokens), stats.steps, stats.drafted, stats.accepted
        )

    def _encode(self, request: Request) -> list[int]:
        from specdec_cli import session

        if not request.chat:
            return session.encode_completion(self.tokenizer, request.prompt)
        messages = list(request.messages)
        if self.settings.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.settings.system})
        return session.encode_chat(self.tokenizer, messages)


def _given(value, default):
    return default if value is None else value
