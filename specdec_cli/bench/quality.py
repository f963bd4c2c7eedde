"""What quantising the target costs in output: the quantised target's greedy tokens against the same model's
unquantised greedy tokens on the same prompts. Speculation on a quantised target reproduces that quantised
target exactly (tests prove it); what changes is the target itself, and this says by how much.

Pure except for `reference_tokens`, which decodes with the engine and times it: the speed the unquantised target
would have had here on the same prompts, beside what quantising it changed."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The index of the first token where the two differ (a shorter one ends: where it ends); None if equal."""
    for index, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return index
    return None if len(reference) == len(other) else min(len(reference), len(other))


def agreement(reference: dict[int, list[int]], quantised: dict[int, list[int]]) -> dict:
    """Over the prompts both decoded: how many gave identical tokens, and where the others first diverged
    (token index; the median over the diverging prompts, None when none diverged)."""
    prompts = sorted(reference.keys() & quantised.keys())
    divergences = {prompt: first_divergence(reference[prompt], quantised[prompt]) for prompt in prompts}
    diverged = [index for index in divergences.values() if index is not None]
    return {
        "compared": len(prompts), "identical": len(prompts) - len(diverged),
        "median_first_divergence": statistics.median(diverged) if diverged else None,
        "first_divergence": {str(prompt): index for prompt, index in divergences.items()},
    }


def reference_tokens(model, prompt_ids: Sequence[list[int]], max_new_tokens: int,
                     eos_ids: Sequence[int]) -> tuple[dict[int, list[int]], float]:
    """Greedy tokens of `model` alone for each prompt (prompt index → tokens), fresh caches per prompt, and the
    seconds their decoding took together (after a warm-up of two tokens on the first prompt: a model's first forward
    pays for its kernels' start)."""
    if prompt_ids:
        SpeculativeDecoder(model, None, FixedK(0), eos_ids).generate(prompt_ids[0], SamplingParams(), 2)
    tokens, seconds = {}, 0.0
    for index, ids in enumerate(prompt_ids):
        decoder = SpeculativeDecoder(model, None, FixedK(0), eos_ids)
        result = decoder.generate(ids, SamplingParams(), max_new_tokens)
        tokens[index], seconds = result.tokens, seconds + result.stats.seconds
    return tokens, seconds
