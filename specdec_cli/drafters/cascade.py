"""Cascade: an n-gram match when the sequence has one (free), the draft model otherwise.

Every step tries the lookup, also when the draft-length policy chose k = 0 for the draft model.

Text that repeats its context (code edits, summaries, extraction, multi-turn chat) gets long free
drafts from prompt lookup; everything else gets the draft model. The draft model's cache simply
catches up on the tokens it skipped the next time it is asked.

`start_after`: the draft model is first asked once the sequence has grown that many tokens past the one
the cascade first saw (lookups draft from the start). The draft's first forward prefills the prompt (up to
its window), which an answer of a dozen tokens cannot pay back (a 192-token prompt: ~0.5 s of a 2.2 s run on
the demo pair); a longer answer pays it a few tokens later."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from specdec_cli.drafters.model import DraftModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.engine.draft import Draft, DraftRule, Drafter

if TYPE_CHECKING:
    from specdec_cli.engine.sampling import SamplingParams


class CascadeDrafter(Drafter):
    name = "cascade"

    def __init__(self, model_drafter: DraftModelDrafter, ngram: NgramDrafter | None = None,
                 min_match: int = 2, lookup_k: int = 8, start_after: int = 0) -> None:
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
        self.start_after = start_after
        self.first: list[int] | None = None  # the sequence first seen (a sequence not extending it starts anew)
        self.model_read = False  # whether the draft model has drafted for that sequence yet

    def propose(
        self, ids: Sequence[int], k: int, params: "SamplingParams", generator: torch.Generator
    ) -> Draft:
        draft = self.ngram.propose(ids, self.lookup_k, params, generator)
        if len(draft):
            self.used_ngram += 1
            return draft
        if not self._model_started(ids):
            return draft
        self.used_model += 1
        first_read = self.start_after and not self.model_read
        self.model_read = True
        draft = self.model_drafter.propose(ids, k, params, generator)
        return replace(draft, prefilled=True) if first_read else draft

    def _model_started(self, ids: Sequence[int]) -> bool:
        """Whether `ids` has grown `start_after` tokens past the first sequence of its kind seen."""
        if not self.start_after:
            return True
        first = self.first
        if first is None or len(ids) < len(first) or list(ids[: len(first)]) != first:
            self.first = first = list(ids)
            self.model_read = False
        return len(ids) - len(first) >= self.start_after

    def reset(self) -> None:
        self.model_drafter.reset()
        self.ngram.reset()
        self.first = None
        self.model_read = False

    def obey(self, rule: DraftRule) -> None:
        self.lookup_k = rule.lookup_k
        self.model_drafter.obey(rule)

    def context_length(self) -> int | None:
        return self.model_drafter.context_length()
