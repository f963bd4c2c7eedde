"""Batched speculative decoding: B sequences per forward, continuous refill. (Interface; body in progress.)"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from specdec_cli.engine.decode import GenerationResult, StopCallback
from specdec_cli.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RowRequest:
    """One sequence for the batch: its prompt, sampling, budget and stop condition."""

    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    stop: StopCallback | None = None


class BatchedDecoder:
    """Decodes up to `batch_size` sequences at once; a finished row takes the next request at once.

    drafter: "none" (the target alone), "model" (the draft model), "ngram" (lookup), "cascade" (lookup
    when it matches, else the draft model); k: an int or "auto"."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None = None, drafter: str = "none",
                 batch_size: int = 8, k: int | str = "auto", eos_token_ids: Sequence[int] = (),
                 verify_curve: dict[int, float] | None = None, draft_curve: dict[int, float] | None = None) -> None:
        raise NotImplementedError

    def stream(self, requests: Iterable[RowRequest]) -> Iterator[tuple[int, GenerationResult]]:
        """(index in `requests`, result) for each request, in the order they finish; each result's
        stats.seconds is that request's own wall time from its admission to its last token."""
        raise NotImplementedError

    def generate_many(self, requests: Sequence[RowRequest]) -> list[GenerationResult]:
        """`stream`, collected in input order."""
        results: dict[int, GenerationResult] = dict(self.stream(requests))
        return [results[index] for index in range(len(requests))]
