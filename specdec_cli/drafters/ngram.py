"""Model-free drafting by prompt lookup: the longest recent n-gram of the sequence that occurred
earlier (in prompt or output) proposes the tokens that followed it there.

An index maps each n-gram (n = 1..max_n) to the end of its most recent earlier occurrence; it grows
with the sequence and is rebuilt only when the sequence is edited rather than extended."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec_cli.engine.draft import EMPTY_DRAFT, Draft, DraftRule, Drafter

if TYPE_CHECKING:
    from specdec_cli.engine.sampling import SamplingParams


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.lookup_k: int | None = None  # set by a policy's rule (`obey`); None: propose k
        self.reset()

    def reset(self) -> None:
        self._indexed: list[int] = []
        self._continuation_at: dict[tuple[int, ...], int] = {}

    def propose(
        self, ids: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        if self.lookup_k is not None:  # a policy's rule: the lookup length it prices worth verifying
            k = min(k, self.lookup_k) if k > 0 else 0
        if k <= 0:
            return EMPTY_DRAFT
        start = self.lookup(ids)
        if start is None:
            return EMPTY_DRAFT
        return Draft(list(ids[start : start + k]), free=True)

    def lookup(self, ids: Sequence[int]) -> int | None:
        """Where the continuation of the longest matching suffix n-gram starts, or None."""
        self._index(ids)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            start = self._continuation_at.get(tuple(ids[len(ids) - n :]))
            if start is not None:
                return start
        return None

    def _index(self, ids: Sequence[int]) -> None:
        indexed = self._indexed
        if len(ids) < len(indexed) or list(ids[: len(indexed)]) != indexed:
            self.reset()
            indexed = self._indexed
        # An n-gram ending at `end` is indexed once a token follows it (end < len(ids)), so the
        # sequence's own suffix never matches itself.
        for end in range(max(len(indexed), 1), len(ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._continuation_at[tuple(ids[end - n : end])] = end
        self._indexed = list(ids)

    def obey(self, rule: DraftRule) -> None:
        self.lookup_k = rule.lookup_k
