"""Draft-length policies: how many tokens to draft in the next step.

A policy sees each step's outcome (drafted, accepted, and the seconds spent drafting and verifying)
and answers `next_k()`. k = 0 means plain target decoding for that step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DraftLengthPolicy(Protocol):
    def next_k(self) -> int: ...

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None: ...

    def reset(self) -> None: ...


@dataclass
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class AdaptiveK:
    """Grow after a fully accepted step, shrink after a rejection, within [min_k, max_k]
    (the heuristic of HF's assisted generation, with its +2 / -1 steps)."""

    start: int = 4
    min_k: int = 1
    max_k: int = 12
    grow: int = 2
    shrink: int = 1

    def __post_init__(self) -> None:
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.max_k, self.k + self.grow)
        else:
            self.k = max(self.min_k, self.k - self.shrink)

    def reset(self) -> None:
        self.k = self.start
