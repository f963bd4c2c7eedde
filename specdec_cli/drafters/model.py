"""A small language model as drafter: k sequential forwards of the draft model, on its own KV cache.

The cache follows the accepted sequence through `CachedModel.extend`'s shared-prefix rule, so after a
step in which every draft was accepted, the draft's last token and the target's bonus token are fed
together in the next step's first forward: no extra forward for the bonus token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec_cli.drafters.base import EMPTY_DRAFT, Draft, Drafter
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.sampling import SamplingParams, logits_to_probs, sample


class DraftModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: torch.nn.Module) -> None:
        self.runner = CachedModel(model)

    def propose(
        self, ids: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        sequence = list(ids)
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        logits = self.runner.extend(sequence, 1)[-1]  # (V_draft,)
        for position in range(k):
            if params.greedy:
                token = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, params)
                token = sample(probs, generator)
                rows.append(probs)
            drafted.append(token)
            if position + 1 < k:
                sequence.append(token)
                logits = self.runner.extend(sequence, 1)[-1]
        return Draft(drafted, torch.stack(rows) if rows else None)

    def reset(self) -> None:
        self.runner.reset()
