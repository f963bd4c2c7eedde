"""Streaming detokenisation: token ids of a reply in, new text out, one piece per token.

A byte-level tokenizer can split one character over several tokens; decoding such a prefix ends in
U+FFFD. So each new token decodes the whole reply so far, and the piece is what that text adds to
what was already shown, held back while it ends in U+FFFD. Special tokens (EOS) are never shown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Piece:
    text: str
    provenance: str  # "accepted" | "resampled" | "bonus" | "target"


class ReplyText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = ""  # the reply's text as far as it has been handed out

    def push(self, tokens: Sequence[int], provenance: Sequence[str]) -> list[Piece]:
        """Take a step's tokens; return the new pieces of text (empty ones are left out)."""
        pieces = []
        for token, origin in zip(tokens, provenance):
            self.tokens.append(int(token))
            new_text = self._new_text()
            if new_text:
                pieces.append(Piece(new_text, str(getattr(origin, "value", origin))))
        return pieces

    def _new_text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith(REPLACEMENT):  # an incomplete character: wait for the token that completes it
            return ""
        new_text, self.shown = text[len(self.shown):], text
        return new_text
