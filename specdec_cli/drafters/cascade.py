"""Cascade: an n-gram match when the sequence has one (free), the draft model otherwise (its chain, or its tree; a
draft of another tokenizer, its chain of text as target ids).

Every step tries the lookup, also when the draft-length policy chose k = 0 for the draft model.

Text that repeats its context (code edits, summaries, extraction, multi-turn chat) gets long free
drafts from prompt lookup; everything else gets the draft model. The draft model's cache simply
catches up on the tokens it skipped the next time it is asked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec_cli.drafters.cross_vocab import CrossVocabDrafter
from specdec_cli.drafters.model import DraftModelDrafter
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.engine.draft import Draft, DraftRule, Drafter

if TYPE_CHECKING:
    from specdec_cli.engine.sampling import SamplingParams


class CascadeDrafter(Drafter):
    name = "cascade"

    def __init__(self, model_drafter: DraftModelDrafter | TreeDrafter | CrossVocabDrafter, ngram: NgramDrafter | None = None,
                 min_match: int = 2, lookup_k: int = 8) -> None:
        """min_match: the shortest n-gram match trusted over the draft model (1-gram matches are
        too often coincidences). lookup_k: tokens proposed from a match, whatever k the policy
        chose for the draft model — a lookup costs nothing and verifying a few more tokens costs
        about as much as verifying one, so a match is used at full length. The policy's
        `DraftRule` replaces it (and the draft model's stop rule) through `obey`."""
        self.model_drafter = model_drafter
        self.ngram = ngram or NgramDrafter(max_n=4, min_n=min_match)
        self.lookup_k = lookup_k
        self.used_ngram = 0
        self.used_model = 0

    def propose(
        self, ids: Sequence[int], k: int, params: "SamplingParams", generator: torch.Generator
    ) -> Draft:
        draft = self.ngram.propose(ids, self.lookup_k, params, generator)
        if len(draft):
            self.used_ngram += 1
            return draft
        self.used_model += 1
        return self.model_drafter.propose(ids, k, params, generator)

    def update(self, ids: Sequence[int], drafted: int, accepted: int) -> None:
        self.model_drafter.update(ids, drafted, accepted)  # a tree keeps its accepted branch (a chain: nothing)

    def reset(self) -> None:
        self.model_drafter.reset()
        self.ngram.reset()

    def obey(self, rule: DraftRule) -> None:
        self.lookup_k = rule.lookup_k
        self.model_drafter.obey(rule)

    def context_length(self) -> int | None:
        return self.model_drafter.context_length()
