"""The drafter interface the decoder calls, and the rule that tells a drafter how far to go.

A drafter proposes up to k tokens to follow a sequence of token ids, with the probabilities it drew
them from (or None: a point mass on each proposed token, as for n-gram lookup), and may learn from how
many the target accepted. Later drafters (token trees) return a `Draft` with `parents` set: draft
token i then continues the path ending at draft token parents[i] (-1 = the sequence itself); a chain
is parents == [-1, 0, 1, ...], the default.

The engine owns this interface: concrete drafters (`specdec_cli.drafters`) import it, never the reverse."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from specdec_cli.engine.sampling import SamplingParams


@dataclass
class Draft:
    ids: list[int]                       # (k,) proposed continuation
    probs: "torch.Tensor | None" = None  # (k, V_draft) distribution each id was drawn from; None = point mass
    parents: list[int] | None = None     # tree drafts only; None = a chain
    free: bool = False                   # drafted at no model cost (lookup): the draft-length policy,
                                         # which prices draft-model tokens, does not learn from it

    def __len__(self) -> int:
        return len(self.ids)


EMPTY_DRAFT = Draft([])


@dataclass(frozen=True)
class DraftRule:
    """How far a drafter goes within the k the policy chose. The policy carries it; drafters obey it.

    min_survival: a draft model stops once the product of its probabilities of its tokens so far (its
    own odds that the whole draft survives) falls below this (0: draft exactly k).
    lookup_k: tokens a free lookup proposes from a match, whatever k is (a lookup costs nothing).
    branch_cut: a tree drafter grows by value instead of by a fixed node budget: a node past its parent's
    most probable child goes in where the draft's odds that its path is the target's reach this (what one more
    node of verify costs, in tokens), and a node is drafted on where its path's odds reach `min_survival`, as a
    chain's next token is; None: trees keep their budget's shape (drafters/tree.py).
    feed_cut: with a branch cut, a level of the tree is drafted on where its most probable node's path odds reach
    `min_survival` (that node pays for the level's draft forward), and the level's other nodes go into that same
    forward where their path odds reach this (what one more row of it and its child's place in the verify cost, in
    tokens); None: every node needs `min_survival`."""

    min_survival: float = 0.0
    lookup_k: int = 8
    branch_cut: float | None = None
    feed_cut: float | None = None


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def propose(
        self, ids: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        """Propose up to k tokens to follow `ids` (prompt + output so far)."""

    def update(self, ids: Sequence[int], drafted: int, accepted: int) -> None:
        """Learn from a verification step; `ids` is the sequence after the step's new tokens."""

    def reset(self) -> None:
        """Forget all state (caches, indexes)."""

    def context_length(self) -> int | None:
        """The positions this drafter's model takes (None: no model, no limit)."""
        return None

    def obey(self, rule: DraftRule) -> None:
        """Take the policy's stop rule (in place: caches survive). Drafters without a stop rule ignore it."""
