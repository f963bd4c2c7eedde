"""Reading `run`'s input: each line → a `Request` (specdec's {"id", "prompt" | "messages"} shape or an
OpenAI Batch API request line), or a request that carries the reason it cannot run; problems never stop
the batch. No torch, no Rich."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.prompts import jsonl
from specdec_cli.errors import InputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
OPENAI_KEYS = ("custom_id", "method", "url", "body")
MAX_SEED = 2**64 - 1  # engine.sampling.MAX_SEED, which this module cannot import without loading torch


@dataclass(frozen=True)
class Request:
    """One input line. Sampling fields left as None take the command's settings."""

    line: int
    id: str | int  # "id" (or "custom_id" on an OpenAI line); the line number when absent
    openai: bool  # an OpenAI Batch API request line: answered in the OpenAI batch output shape
    chat: bool = False  # messages through the chat template, else a raw prompt
    prompt: str | None = None
    messages: tuple[dict, ...] = ()
    generation_prompt: bool = True  # the template's header of a new assistant turn after the messages
    continue_final: bool = False  # the last message left open, for the model to go on with it
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    error: str | None = None  # why this line cannot run; it becomes an error record
    id_given: bool = True  # False: the line has no id and `id` is its line number
    digest: str = dataclasses.field(default="", compare=False)  # of the line as written (`line_digest`)

    @property
    def key(self) -> str:
        """What resume matches output records on: the id as JSON, so 7 and "7" stay apart."""
        return json.dumps(self.id)


class BadRecord(ValueError):
    """What is wrong with one input line; it becomes that line's error record."""


def read_requests(lines: Iterable[bytes]) -> list[Request]:
    """Every non-blank line as a request, numbered from 1; a later duplicate id becomes an error."""
    requests: list[Request] = []
    first: dict[str, Request] = {}
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            request = dataclasses.replace(parse_line(number, raw), digest=line_digest(number, raw))
            if request.key in first and request.error is None:
                request = _failed(request, _duplicate(request, first[request.key]))
            first.setdefault(request.key, request)
            requests.append(request)
    return requests


def line_digest(number: int, raw: bytes) -> str:
    """What tells two requests under one id apart on --resume: the line's bytes (without the spaces and line end
    around them, or line 1's byte-order mark), hashed."""
    text = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw
    return hashlib.sha256(text.strip()).hexdigest()[:16]


def _duplicate(request: Request, earlier: Request) -> str:
    """Why a line's id is taken; a line without an id took its line number, which a user may not expect."""
    if not earlier.id_given:
        return f"duplicate id {request.id!r}: line {earlier.line} has no id, so it took its line number {earlier.id!r} as id"
    if not request.id_given:
        return (f"duplicate id {request.id!r} (first on line {earlier.line}): this line has no id, so it took its "
                "line number as id")
    return f"duplicate id {request.id!r} (first on line {earlier.line})"


def parse_line(number: int, raw: bytes) -> Request:
    try:
        value = json.loads(_decode(number, raw))
        if not isinstance(value, dict):
            raise BadRecord(f"expected a JSON object, got {_json_type(value)}")
    except (BadRecord, json.JSONDecodeError, RecursionError) as error:  # RecursionError: nested past the limit
        return Request(number, number, openai=False, error=f"line {number}: {_problem(error)}", id_given=False)
    openai = any(key in value for key in OPENAI_KEYS)
    try:
        record_id = _record_id(value, "custom_id" if openai else "id", number)
    except BadRecord as error:
        return Request(number, number, openai, error=f"line {number}: {error}", id_given=False)
    given = value.get("custom_id" if openai else "id") is not None
    try:
        _refuse_lone_surrogates(value)
        fields = _openai_fields(value) if openai else _plain_fields(value)
    except BadRecord as error:
        return Request(number, record_id, openai, error=f"line {number}: {error}", id_given=given)
    return Request(number, record_id, openai, id_given=given, **fields)


def _decode(number: int, raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRecord(f"not UTF-8 (byte {error.start + 1})") from None
    return text.removeprefix("\ufeff") if number == 1 else text


def _problem(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return f"the line {jsonl.TOO_DEEP}"
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error.msg} at column {error.colno})"
    return str(error)


def _failed(request: Request, problem: str) -> Request:
    return Request(request.line, request.id, request.openai, error=f"line {request.line}: {problem}",
                   id_given=request.id_given, digest=request.digest)


def _json_type(value: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _record_id(value: dict, key: str, number: int) -> str | int:
    record_id = value.get(key)
    if record_id is None:
        return number
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
        raise BadRecord(f'"{key}" must be a string or an integer, got {_json_type(record_id)}')
    half = jsonl.lone_surrogate(record_id, key) if isinstance(record_id, str) else None
    if half is not None:
        raise BadRecord("; ".join(jsonl.lone_surrogate_problem(*half)))
    return record_id


def _refuse_lone_surrogates(value: dict) -> None:
    """A lone surrogate anywhere in the line is that line's error record: in a prompt it stopped the whole batch with
    the tokenizer's TypeError traceback, and in metadata the record could not be written as UTF-8."""
    found = jsonl.lone_surrogate(value)
    if found is not None:
        raise BadRecord("; ".join(jsonl.lone_surrogate_problem(*found)))


def _plain_fields(value: dict) -> dict:
    _refuse_near_misses(value)
    prompt, messages = value.get("prompt"), value.get("messages")
    if prompt is None and messages is None:
        raise BadRecord('no "prompt" or "messages"')
    if prompt is not None and messages is not None:
        raise BadRecord('both "prompt" and "messages": give one')
    limit_key = _plain_limit_key(value)
    return {**_input_fields(prompt, messages, value), **_sampling_fields(value, value.get(limit_key), limit_key)}


def _plain_limit_key(value: dict) -> str:
    """Which key holds a plain line's token limit: transformers' max_new_tokens or vLLM's and OpenAI's max_tokens
    (both are read: a line whose limit were ignored would run to the command's limit), not both."""
    given = [key for key in ("max_new_tokens", "max_tokens") if value.get(key) is not None]
    if len(given) == 2:
        raise BadRecord('both "max_new_tokens" and "max_tokens": give one')
    return given[0] if given else "max_new_tokens"


def _openai_fields(value: dict) -> dict:
    method, url, body = value.get("method"), value.get("url"), value.get("body")
    if method != "POST":
        raise BadRecord(f'unsupported method {method!r}: OpenAI batch lines use "POST"')
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BadRecord(f"unsupported url {url!r}: use {CHAT_URL} or {COMPLETIONS_URL}")
    if not isinstance(body, dict):
        raise BadRecord(f'"body" must be an object, got {_json_type(body)}')
    _refuse_near_misses(body)
    wanted, other = ("messages", "prompt") if url == CHAT_URL else ("prompt", "messages")
    if body.get(wanted) is None:
        raise BadRecord(f'{url} needs "{wanted}" in "body"' + (f', not "{other}"' if other in body else ""))
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    inputs = _input_fields(*((body.get("prompt"), None) if wanted == "prompt" else (None, body["messages"])), body)
    return {**inputs, **_sampling_fields(body, body.get(max_key), max_key)}


def _input_fields(prompt: object, messages: object, value: dict) -> dict:
    template = _template_fields(value)
    if messages is not None:
        return {"chat": True, "messages": _messages(messages), **template}
    if template:
        key = next(key for key in TEMPLATE_KEYS.values() if value.get(key) is not None)
        raise BadRecord(f'"{key}" is for "messages" (the chat template): a "prompt" goes to the model as it is')
    if not isinstance(prompt, str):
        raise BadRecord(f'"prompt" must be a string, got {_json_type(prompt)}')
    if not prompt:
        raise BadRecord('"prompt" is empty')
    return {"chat": False, "prompt": prompt}


TEMPLATE_KEYS = {"generation_prompt": "add_generation_prompt", "continue_final": "continue_final_message"}


def _template_fields(value: dict) -> dict:
    """vLLM's chat options for the template: `continue_final_message` leaves the last message open for the model to go
    on with it (a reply begun for it), which needs `add_generation_prompt` false (its default then)."""
    given = {}
    for field, key in TEMPLATE_KEYS.items():
        if value.get(key) is not None:
            if not isinstance(value[key], bool):
                raise BadRecord(f'"{key}" must be true or false, got {_json_type(value[key])}')
            given[field] = value[key]
    if given.get("continue_final"):
        if given.get("generation_prompt"):
            raise BadRecord('"continue_final_message" and "add_generation_prompt" cannot both be true: the last message '
                            "is continued, or a new assistant turn begins")
        given["generation_prompt"] = False
    return given


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
    if isinstance(content, list):
        other = next(part for part in content if not _is_text_part(part))
        if isinstance(other, dict) and isinstance(other.get("type"), str) and other["type"] != "text":
            raise BadRecord(f'messages[{index}].content holds a part of type "{other["type"]}": specdec runs text models, '
                            'so a message\'s parts must all be {"type": "text", "text": ...}')
    if content is None and message.get("tool_calls"):
        raise BadRecord(f'messages[{index}] holds "tool_calls": specdec does not run tools, so a conversation cannot '
                        'hold tool calls or their results')
    if not isinstance(content, str):
        raise BadRecord(f'messages[{index}].content must be a string or a list of text parts, got {_json_type(content)}')
    return {"role": message["role"], "content": content}


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


# Settings of HF's generate, vLLM and OpenAI that change what a request gets and that specdec does not do, each with
# the values that change nothing. A line asking for one otherwise is that line's error record: ignoring it would
# answer another request than the one asked (a penalty not applied, free text where JSON was asked for, no logprobs
# where they were).
NEUTRAL = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "min_p": (0,), "typical_p": (1,), "num_beams": (1,), "best_of": (1,), "num_return_sequences": (1,),
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "response_format": ({"type": "text"},), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "use_beam_search": (False,), "no_repeat_ngram_size": (0,), "bad_words": ([],), "bad_words_ids": ([],),
    "prompt_logprobs": (), "logits_processors": ([],),
}
# The same for how a request ends and what its text holds (vLLM's and HF's names): `ignore_eos`, which benchmark
# scripts set to get fixed lengths, decoded past the end of text where specdec stops there, and said nothing.
ENDING = {
    "ignore_eos": (False,), "min_tokens": (0,), "min_new_tokens": (0,), "stop_token_ids": ([],),
    "skip_special_tokens": (True,), "include_stop_str_in_output": (False,),
}
WHY = ("specdec samples the model's own distribution: temperature, top_p, top_k, seed, stop",
       "specdec ends a request at the model's end of text, a stop string or the token limit, and its text leaves out "
       "special tokens and the stop string")
UNSUPPORTED = tuple((key, neutral, WHY[0]) for key, neutral in NEUTRAL.items()) + tuple(
    (key, neutral, WHY[1]) for key, neutral in ENDING.items())


def _refuse_unsupported(value: dict) -> None:
    for key, neutral, why in UNSUPPORTED:
        given = value.get(key)
        if given is not None and not any(given == same and isinstance(given, bool) == isinstance(same, bool)
                                         for same in neutral):  # true is not 1 here, nor false 0
            instead = f" or set it to {json.dumps(neutral[0])}" if neutral else ""
            raise BadRecord(f'unsupported "{key}": {json.dumps(given)[:40]} ({why}); leave it out{instead}')
    if value.get("do_sample") is not None and not isinstance(value["do_sample"], bool):
        raise BadRecord(f'"do_sample" must be true or false, got {_json_type(value["do_sample"])}')


SETTINGS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "n", "do_sample", "prompt", "messages", *TEMPLATE_KEYS.values(), *NEUTRAL, *ENDING)


def _refuse_near_misses(value: dict) -> None:
    """A key that is not a setting but is one letter or two from one the line lacks ("max_token", "temprature") is
    that line's error: other keys are kept as metadata, so such a line ran with the command's setting instead of the
    one it asked for, and nothing said so."""
    for key in value:
        if key in SETTINGS or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, SETTINGS, 1, cutoff=0.85)
        if close and close[0] not in value:
            raise BadRecord(f'unknown "{key}": did you mean "{close[0]}"? (a line\'s other keys are kept as metadata: '
                            "rename it if it is one)")


def _sampling_fields(value: dict, max_tokens: object, max_key: str) -> dict:
    """The optional per-request settings; null means unset, like a missing key. HF's `"do_sample": false` means
    greedy, as in generate (whatever the temperature)."""
    _refuse_unsupported(value)
    if value.get("n") not in (None, 1) or isinstance(value.get("n"), bool):  # a plain line's too: it was ignored
        raise BadRecord(f'"n" must be 1 (one completion per request), got {json.dumps(value["n"])[:40]}')
    greedy = value.get("do_sample") is False
    return {
        "max_new_tokens": _optional(max_tokens, lambda v: _integer(max_key, v, 1)),
        "temperature": 0.0 if greedy else _optional(value.get("temperature"),
                                                    lambda v: _number("temperature", v, 0.0, None)),
        "top_p": _optional(value.get("top_p"), lambda v: _number("top_p", v, 0.0, 1.0, open_low=True)),
        "top_k": _optional(value.get("top_k"), _top_k),
        "seed": _optional(value.get("seed"), lambda v: _integer("seed", v, 0, MAX_SEED)),
        "stop": _stop(value.get("stop")),
    }


def _top_k(value: object) -> int:
    """0 keeps every token, and so does vLLM's -1 (its default: lines written for vLLM carry it)."""
    if value == -1 and not isinstance(value, bool):
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise BadRecord(f'"top_k" must be at least 0 (or -1, as vLLM has it: every token), got {value}')
    return _integer("top_k", value, 0)


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
    if not isinstance(stops, list):
        raise BadRecord(f'"stop" must be a string or a list of strings, got {_json_type(stop)}')
    odd = [each for each in stops if not isinstance(each, str)]
    if odd:
        raise BadRecord(f'"stop" must be a string or a list of strings, got a list holding {_json_type(odd[0])}')
    if "" in stops:
        raise BadRecord('"stop" holds an empty string')
    return tuple(stops)


def refuse_one_document(requests: list[Request], lines: list[bytes], source: str) -> None:
    """A file that is one JSON document rather than JSON lines (a list of requests, an object indented over several
    lines) made an error record of every line: refused whole, before anything is written."""
    if requests and all(request.error is not None for request in requests):
        try:
            jsonl.refuse_one_document(b"\n".join(lines).decode("utf-8"), source)
        except UnicodeDecodeError:
            pass


def read_input(source: str) -> list[bytes]:
    """The lines of INPUT (`-`: stdin), as bytes: a line that is not UTF-8 fails alone."""
    if source == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as error:
            raise InputError(f"cannot read {source}: {error.strerror}", "check the input path") from None
    jsonl.refuse_wide_encoding(data, source)
    return data.splitlines()
