"""`run`'s output records: a finished request → specdec's record or the OpenAI batch output shape,
or an error record naming the problem. No torch, no Rich."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from specdec_cli.batch.requests import Request
from specdec_cli.engine.stats import GenerationStats


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
    note: str | None = None  # e.g. why max_new_tokens was cut to fit the context
    drafted_steps: int = 0  # steps that drafted
    held_steps: int = 0     # steps the policy kept from drafting because drafting measured slower than not
    policy: str | None = None  # why it did, the measurement

    @classmethod
    def of(cls, text: str, finish_reason: str, prompt_tokens: int, stats: GenerationStats,
           note: str | None = None) -> Completion:
        return cls(text, finish_reason, prompt_tokens, stats.new_tokens, stats.steps, stats.drafted, stats.accepted,
                   note, stats.drafted_steps, stats.held_steps, stats.policy)

    def stats(self, seconds: float) -> GenerationStats:
        """Its counts as the engine's stats, timed by the loop's wall time."""
        return GenerationStats(new_tokens=self.completion_tokens, steps=self.steps, drafted=self.drafted,
                               accepted=self.accepted, seconds=seconds)


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
        **_note(completion),
    }


def _note(completion: Completion) -> dict:
    """A "note" field only when there is something to say (the record's other fields never change shape)."""
    return {"note": completion.note} if completion.note else {}


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
    stats = completion.stats(seconds)
    return {
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4) if stats.drafted else None,
        "tokens_per_step": round(stats.tokens_per_step, 4),
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "seconds": round(seconds, 4),
        "drafted_steps": completion.drafted_steps,
        "held_steps": completion.held_steps,
        "policy": completion.policy,
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
        "specdec": record_stats(completion, seconds) | _note(completion),
    }


def record_key(record: dict) -> str:
    """The key `Request.key` gives the request this output record answers."""
    return json.dumps(record["custom_id"] if "custom_id" in record else record["id"])


def record_failed(record: dict) -> bool:
    return record.get("finish_reason") == "error" or bool(record.get("error"))
