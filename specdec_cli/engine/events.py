"""What one verification step yields: the tokens it added, where each came from, and its counts.

The decoders (`decode`, `batched`) make these; `stats.GenerationStats` sums them. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Provenance(str, Enum):
    ACCEPTED = "accepted"    # a draft token the target kept
    RESAMPLED = "resampled"  # the target's replacement at the first rejection
    BONUS = "bonus"          # the target's extra token after a fully accepted draft
    TARGET = "target"        # plain decoding (nothing was drafted)


@dataclass(frozen=True)
class StepEvent:
    tokens: list[int]
    provenance: list[Provenance]
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    finish_reason: str | None  # "stop" (EOS or the stop callback), "length", or None to go on
    free: bool = False  # the draft cost nothing (a lookup drafter's)
    tree_nodes: int = 0  # a tree draft's size (`drafted` counts its nodes too); 0 for a chain
    tree_depth: int = 0  # a tree draft's deepest path, in tokens (`accepted` is the accepted path's)
    tree_addresses: tuple[tuple[int, ...], ...] = ()  # each node's place (tree.addresses); () for a chain
    tree_accepted_address: tuple[int, ...] = ()  # the place of the accepted path's last node (its prefixes too)
    held: str | None = None  # why the policy kept this step from drafting (drafting measured slower), else None
