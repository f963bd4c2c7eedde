"""A small language model as drafter: k sequential forwards of the draft model, on its own KV cache.

The cache follows the accepted sequence through `CachedModel.extend`'s shared-prefix rule, so after a
step in which every draft was accepted, the draft's last token and the target's bonus token are fed
together in the next step's first forward: no extra forward for the bonus token.

Four options cut wasted draft work, all lossless:
- `window`: the draft model reads only the last `window` tokens of the sequence it first sees (and all that
  follows; window.py says why and how the start moves);
- `token_ids`: the draft scores only this subset of the vocabulary (see subset_head.py; `share_head`: the
  subset head is built once per model and id set, for drafters made again and again on one model);
- `min_confidence`: stop drafting once the draft's own top probability falls below it (a token
  the draft itself doubts is likely rejected, and every later draft token with it);
- `min_survival`: stop drafting once the product of the draft's probabilities of its tokens so far
  (its own estimate that the whole draft survives verification) falls below it. The token that
  crossed the line is still proposed: it is already paid for, only the next forward is saved.
  Sampling draws from the distribution after top-k and top-p, but the odds are read before them
  (`draft_odds`): renormalised within the nucleus a token often has probability 1 where the target,
  whose nucleus may hold more, accepts it only with its own probability of it, and with such factors
  of 1 the survival product never fell.
  The draft-length policy sets it through `obey` (its `DraftRule`); the constructor's value stands
  only while no policy has a rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec_cli.engine.draft import EMPTY_DRAFT, Draft, DraftRule, Drafter
from specdec_cli.drafters.subset_head import subset_head, with_prompt_path
from specdec_cli.drafters.window import DraftWindow
from specdec_cli.engine.context import context_length
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.sampling import argmax_ids, draft_odds, logits_to_probs, sample

if TYPE_CHECKING:
    from specdec_cli.engine.sampling import SamplingParams


class DraftModelDrafter(Drafter):
    name = "model"

    def __init__(
        self, model: torch.nn.Module, token_ids: torch.Tensor | None = None, min_confidence: float = 0.0,
        min_survival: float = 0.0, share_head: bool = False, window: int | None = None,
    ) -> None:
        self.subset = token_ids.cpu() if token_ids is not None else None
        self.head = subset_head(model, self.subset, share_head)
        self.runner = CachedModel(with_prompt_path(self.head or model, model))
        self.context = context_length(model)
        self.min_confidence = min_confidence
        self.min_survival = min_survival
        self.window = DraftWindow(window)

    def propose(
        self, ids: Sequence[int], k: int, params: "SamplingParams", generator: torch.Generator
    ) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        sequence = self.window.seen(ids)
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        self.runner.prefill(sequence[:-1])  # a long unread part: through the draft's prompt path, where it has one
        logits = self.runner.extend(sequence, 1)[-1]  # (V_draft,) or (|subset|,)
        survival = 1.0
        for position in range(k):
            if params.greedy:
                index = argmax_ids(logits)[0]
            else:
                probs = logits_to_probs(logits, params)
                index = sample(probs, generator)
            check = self.min_survival or (self.min_confidence and position)  # else the odds decide nothing
            confidence = float(draft_odds(logits, params)[index]) if check else 1.0
            if position and confidence < self.min_confidence:
                break
            drafted.append(self._token_id(index))
            if not params.greedy:
                rows.append(self._on_full_vocab(probs))
            survival *= confidence
            if survival < self.min_survival:
                break
            if position + 1 < k:
                sequence.append(drafted[-1])
                logits = self.runner.extend(sequence, 1)[-1]
        return Draft(drafted, torch.stack(rows) if rows else None)

    def _token_id(self, index: int) -> int:
        return self.head.token_id(index) if self.head is not None else index

    def _on_full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """(V_draft,) probabilities: a subset head's mass scattered back, 0 outside the subset."""
        return probs if self.head is None else self.head.on_full_vocabulary(probs)

    def reset(self) -> None:
        self.runner.reset()
        self.window.reset()

    def obey(self, rule: DraftRule) -> None:
        self.min_survival = rule.min_survival

    def context_length(self) -> int | None:
        return self.context
