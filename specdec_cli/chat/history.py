"""The conversation as text: the system prompt, the turns, and the transcript saved by /save."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec_cli.errors import InputError


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    finish_reason: str | None = None  # assistant only: "stop", "length" or "interrupted"
    stats: dict | None = None  # assistant only: GenerationStats.as_dict()

    def record(self) -> dict:
        extra = {"finish_reason": self.finish_reason, "stats": self.stats} if self.role == "assistant" else {}
        return {"role": self.role, "content": self.content, **extra}


@dataclass
class History:
    system: str | None = None
    messages: list[Message] = field(default_factory=list)

    def template_messages(self) -> list[dict]:
        """What the chat template renders: the system prompt (if any) and every turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": message.role, "content": message.content} for message in self.messages]

    def records(self) -> list[dict]:
        """The transcript, one JSON object per message (the system prompt first, if any)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [message.record() for message in self.messages]


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Write `records` as JSON lines, atomically: a failed write leaves any old file as it was."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise InputError(f"cannot write {path}: {error.strerror}", "pick a folder you can write to") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {error.strerror}", "pick another path") from None
