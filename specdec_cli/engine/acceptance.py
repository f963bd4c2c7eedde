"""Pure acceptance rules: given what the drafter proposed and what the target computed, which tokens stay.

greedy_verdict keeps exactly the target's argmax sequence. sampling_verdict is the rejection scheme of
Leviathan et al. (2023) / Chen et al. (2023): the kept tokens are distributed exactly as the target's
`target_probs`, whatever the draft distribution `draft_probs` was."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_cli.engine.sampling import argmax_ids, sample


@dataclass(frozen=True)
class Verdict:
    accepted: int       # how many leading draft tokens the target kept
    next_token: int     # the target's own token after them: a correction, or the bonus
    is_bonus: bool      # True when every draft token was kept (next_token extends a full draft)


def greedy_verdict(draft_ids: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits: (k+1, V_target), row i scores the token after draft_ids[:i]."""
    target_argmax = argmax_ids(target_logits)  # (k+1,)
    accepted = 0
    for drafted, wanted in zip(draft_ids, target_argmax):
        if drafted != wanted:
            break
        accepted += 1
    return Verdict(accepted, target_argmax[accepted], accepted == len(draft_ids))


def sampling_verdict(
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """draft_probs: (k, V_draft) or None for a drafter without probabilities (a point mass on each
    drafted token); target_probs: (k+1, V_target). Widths may differ (padded vocabularies): the
    draft's distribution is compared over the target's range, where the target may emit any id."""
    k = len(draft_ids)
    target_probs = target_probs.float().cpu()
    target_width = target_probs.shape[-1]
    p_target = torch.tensor(
        [float(target_probs[i, x]) if x < target_width else 0.0 for i, x in enumerate(draft_ids)]
    )
    if draft_probs is None:
        p_draft = torch.ones(k)
    else:
        draft_probs = draft_probs.float().cpu()
        p_draft = draft_probs[torch.arange(k), torch.tensor(draft_ids, dtype=torch.long)]
    uniforms = torch.rand(k, generator=generator)
    # Accept x with probability min(1, p_target(x) / p_draft(x)), i.e. u * p_draft < p_target.
    kept = (uniforms * p_draft < p_target).tolist()
    accepted = next((i for i, ok in enumerate(kept) if not ok), k)
    if accepted == k:
        return Verdict(k, sample(target_probs[k], generator), True)
    draft_row = _draft_row_on_target_range(draft_ids[accepted], draft_probs, accepted, target_width)
    residual = (target_probs[accepted] - draft_row).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # only reachable through float round-off: fall back to the target itself
        residual, total = target_probs[accepted], target_probs[accepted].sum()
    return Verdict(accepted, sample(residual / total, generator), False)


def _draft_row_on_target_range(
    token: int, draft_probs: torch.Tensor | None, row: int, target_width: int
) -> torch.Tensor:
    """(V_target,) draft distribution at one position: zero-padded or cut to the target's width; a
    point mass on the drafted id when the drafter gave no probabilities."""
    if draft_probs is None:
        point_mass = torch.zeros(target_width)
        if token < target_width:
            point_mass[token] = 1.0
        return point_mass
    probs = draft_probs[row]
    if probs.shape[-1] >= target_width:
        return probs[:target_width]
    return torch.nn.functional.pad(probs, (0, target_width - probs.shape[-1]))
