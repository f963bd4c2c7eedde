"""Sampling parameters and the one logits -> probabilities transform shared by draft and target.

Speculative sampling is exact only if the draft's and the target's distributions are shaped by the
same temperature / top-k / top-p, so both go through `logits_to_probs`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


# Temperatures below this decode greedily, as in vLLM (its _SAMPLING_EPS): logits divided by them overflow float32
# (5e-324: every probability NaN), and well above that they already leave only the argmax.
GREEDY_BELOW = 1e-5
MAX_SEED = 2**64 - 1  # a torch.Generator's manual_seed takes 0 .. this (and negatives, which no user means)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW) means greedy (argmax); top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each check is written as "not in range" (and inf is out of range).
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:  # past it, every request failed in manual_seed
            raise ValueError(f"seed must be from 0 to {MAX_SEED}, got {self.seed} (no seed: a random one)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: the same seed gives the same draws on every device."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p."""
    if params.greedy:
        return _one_hot_argmax(logits)
    if params.top_k and params.top_k < logits.shape[-1]:
        return _top_k_probs(logits.float(), params)
    scores = logits.float() / params.temperature
    if params.top_p < 1.0:
        scores = _mask_outside_top_p(scores, params.top_p)
    return torch.softmax(scores, dim=-1)


def draft_odds(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) the draft's own odds of each token being accepted, as the survival cut reads them: its softmax at
    the sampling temperature, before top-k and top-p (greedy: at temperature 1); drafters/model.py says why. The
    nucleus's renormalised probabilities overstate a token's odds where the draft is unsure, so the cut would draft
    on where drafts are then mostly rejected. The batched engine reads the same odds (engine/batched.py)."""
    scores = logits.float() if params.greedy else logits.float() / params.temperature
    return torch.softmax(scores, dim=-1)


def _top_k_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p among those k, computed over the k candidates only (sorting a whole vocabulary for
    top-p is costly on a CPU core; k candidates cost next to nothing) and scattered back to (..., V). The
    candidates are found on the float32 logits and only their values divided by the temperature: dividing by
    a positive number keeps the order, so those are the k + 1 best scores, the same floats. A tie at the k-th
    score (after the division) keeps every tied id, as a mask does: that rare case takes the
    whole-vocabulary path."""
    values, indices = top_k(logits, params.top_k + 1)  # (..., k + 1), best first: the one past the k tells a tie
    values = values / params.temperature
    kth_best = values[..., params.top_k - 1: params.top_k]
    if bool((values[..., -1:] == kth_best).any()):  # more than k ids score at least the k-th best
        scores = logits / params.temperature
        masked = scores.masked_fill(scores < kth_best, float("-inf"))
        if params.top_p < 1.0:
            masked = _mask_outside_top_p(masked, params.top_p)
        return torch.softmax(masked, dim=-1)
    values, indices = values[..., :-1], indices[..., :-1]
    if params.top_p < 1.0:
        candidate_probs = torch.softmax(values, dim=-1)
        mass_before = torch.cumsum(candidate_probs, dim=-1) - candidate_probs
        values = values.masked_fill(mass_before >= params.top_p, float("-inf"))
    return torch.zeros_like(logits).scatter_(-1, indices, torch.softmax(values, dim=-1))


class RowKernels(Protocol):
    """Faster passes over vocabulary-wide rows (models/row_kernels.py: specdec's C ones). Each returns None where
    it declines, and the torch code below decides."""

    def top_k(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def support(self, probs: torch.Tensor) -> torch.Tensor | None: ...


_row_kernels: RowKernels | None = None


def use_row_kernels(kernels: RowKernels | None) -> None:
    """Run top_k and sample's support through `kernels` from now on (None: torch's code). Installed when
    specdec's kernel library loads; the results are the same either way (tested)."""
    global _row_kernels
    _row_kernels = kernels


TOP_K_BLOCK = 64  # top_k reads a row's maximum per block of this many ids first


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores, k, dim=-1) for a few rows of a large vocabulary, faster on a CPU than torch.topk's pass
    over every id: the k best ids lie in the blocks whose maximum is at least the k-th best block maximum (k
    distinct ids score that much), so a pass of block maxima, then topk over those blocks' ids. The same values,
    best first; among equal values the order may differ from torch.topk's (which does not promise one either).
    With row kernels installed, one pass of C over each row instead."""
    width = scores.shape[-1]
    if _row_kernels is not None:
        found = _row_kernels.top_k(scores.reshape(-1, width), k)
        if found is not None:
            shape = (*scores.shape[:-1], k)
            return found[0].view(shape), found[1].view(shape)
    if width < 16 * k * TOP_K_BLOCK:
        return torch.topk(scores, k, dim=-1)
    rows = scores.reshape(-1, width)
    padding = -width % TOP_K_BLOCK
    if padding:
        rows = torch.nn.functional.pad(rows, (0, padding), value=float("-inf"))
    blocks = rows.view(rows.shape[0], -1, TOP_K_BLOCK)  # (R, B, 64)
    block_max = blocks.amax(dim=-1)  # (R, B)
    least = torch.topk(block_max, k, dim=-1).values[:, -1]  # (R,)
    offsets = torch.arange(TOP_K_BLOCK)
    values, indices = [], []
    for row in range(rows.shape[0]):
        chosen = (block_max[row] >= least[row]).nonzero().flatten()  # at least k blocks (NaN compares false)
        if len(chosen) < k:
            row_values, place = torch.topk(rows[row], k)
            values.append(row_values)
            indices.append(place)
            continue
        row_values, place = torch.topk(blocks[row, chosen].flatten(), k)
        values.append(row_values)
        indices.append((chosen[:, None] * TOP_K_BLOCK + offsets).flatten()[place])
    shape = (*scores.shape[:-1], k)
    return torch.stack(values).view(shape), torch.stack(indices).view(shape)


def _mask_outside_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a (V,) distribution. Draws on the CPU so seeds are device-independent. Only
    the ids with mass take part (top-k leaves a handful): multinomial over a whole vocabulary is costly on a CPU
    core, over its support next to nothing; the distribution is the same."""
    probs = probs.float().cpu()
    support = nonzero_ids(probs)  # (n,) ids with mass
    if len(support) == probs.numel():
        return int(torch.multinomial(probs, 1, generator=generator))
    return int(support[torch.multinomial(probs[support], 1, generator=generator)])


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of (..., V) logits, flattened to a list (the first of equal maxima, as torch.argmax
    gives): one C pass a row with row kernels installed (a greedy verify's rows are cold in the caches after the
    forward, where torch.argmax is slow)."""
    width = logits.shape[-1]
    if _row_kernels is not None:
        found = _row_kernels.top_k(logits.reshape(-1, width), 1)
        if found is not None:
            return found[1].flatten().tolist()
    return logits.reshape(-1, width).argmax(dim=-1).tolist()


def spread(probs: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """(n,) probabilities over `ids` (a subset of a vocabulary, in order) as (width,): each id's mass in its own
    place, 0 elsewhere. Only the ids with mass are copied (top-k leaves a handful of a 65,536-id subset)."""
    probs = probs.cpu()
    with_mass = nonzero_ids(probs)
    whole = torch.zeros(width, dtype=probs.dtype)
    whole[ids[with_mass]] = probs[with_mass]
    return whole


def nonzero_ids(probs: torch.Tensor) -> torch.Tensor:
    """(n,) the ids of a (V,) distribution's nonzero entries, in order: torch.nonzero, or one C pass with row
    kernels installed (quicker on a row a forward has pushed out of the caches)."""
    if _row_kernels is not None:
        found = _row_kernels.support(probs)
        if found is not None:
            return found
    return probs.nonzero().flatten()
