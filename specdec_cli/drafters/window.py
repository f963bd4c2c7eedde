"""The part of a sequence a draft model reads: all of it, or the last `size` tokens of the first sequence it
sees and everything after them.

Why: a long prompt's prefill costs the 0.5B demo draft a third of what it costs the 1.5B target, and a draft
conditions mostly on the recent tokens (lookups cover copying from further back). Lossless: the target still
verifies every token. The start stays where it was set while the sequence keeps the dropped tokens, so every
step and chat turn extends the same draft cache; a sequence that no longer begins with them sets it anew."""

from __future__ import annotations

from collections.abc import Sequence


class DraftWindow:
    def __init__(self, size: int | None) -> None:
        if size is not None and size < 1:
            raise ValueError(f"a draft window needs at least one token, got {size}")
        self.size = size
        self.dropped: list[int] | None = None  # the tokens before the window (None: not set yet)

    def seen(self, ids: Sequence[int]) -> list[int]:
        """The tokens of `ids` the draft reads, moving the window's start if `ids` lost the dropped tokens."""
        if self.size is None:
            return list(ids)
        dropped = self.dropped
        if dropped is None or len(ids) <= len(dropped) or list(ids[: len(dropped)]) != dropped:
            self.dropped = list(ids[: max(0, len(ids) - self.size)])
        return list(ids[len(self.dropped):])

    def within(self, ids: Sequence[int]) -> list[int] | None:
        """`ids` as the draft reads them with the window where it is; None when `ids` lost the dropped tokens."""
        dropped = self.dropped or []
        if self.size is not None and (len(ids) < len(dropped) or list(ids[: len(dropped)]) != dropped):
            return None
        return list(ids[len(dropped):])

    def reset(self) -> None:
        self.dropped = None
