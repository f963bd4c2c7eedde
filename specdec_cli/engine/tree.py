"""Token trees: their shape (mask, positions, paths) and their acceptance rules. Pure functions, no models.

A tree is given as `parents`: node i continues the path that ends at node parents[i] (-1: the sequence
itself), and parents[i] < i (a parent comes before its children). Siblings are tried in node order.

Acceptance walks the tree from the sequence:
- greedy: at each node, the child whose token is the target's argmax, if there is one;
- sampling: multi-candidate rejection (SpecInfer, Miao et al. 2024; multi-draft speculative sampling):
  the children are tried in order, each accepted with probability min(1, p(x) / q(x)) where p is the
  target's distribution at the node (the residual after earlier rejections) and q the distribution the
  child was drawn from (a point mass for a child chosen deterministically); after a rejection
  p <- normalise(max(0, p - q)). When every child is rejected the next token is drawn from what is left
  of p. Each try is one ordinary speculative-sampling step towards the current residual, so the token
  emitted at a node is distributed exactly as the target's p, provided every child was drawn
  independently of the verification from the q it is reported with (which may depend on its elder
  siblings: the tree drafter draws distinct children, each from q less the ids before it), or chosen
  deterministically."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec_cli.engine.acceptance import _draft_row_on_target_range as _draft_row
from specdec_cli.engine.sampling import argmax_ids, sample


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]     # the accepted nodes, root first (each the child of the one before)
    next_token: int     # the target's own token after the path: a correction, or the bonus
    is_bonus: bool      # True when the path ends at a leaf (nothing left to reject)


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 0 for a child of the sequence."""
    found: list[int] = []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"node {node}: parent {parent} must be -1 or an earlier node")
        found.append(0 if parent < 0 else found[parent] + 1)
    return found


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """parent (-1: the sequence) -> its children, in node order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def path_to(node: int, parents: list[int]) -> list[int]:
    """The nodes from a root down to `node` (empty for -1)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def addresses(parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's place in the tree as sibling ranks from the root down: (0,) the first root, (1, 0)
    the second root's first child. The same place in two steps' trees is the same address, so
    acceptance can be counted per place (stats.py)."""
    found: list[tuple[int, ...]] = []
    children: dict[int, int] = {}
    for parent in parents:
        rank = children.get(parent, 0)
        children[parent] = rank + 1
        found.append((found[parent] if parent >= 0 else ()) + (rank,))
    return found


def ancestry(parents: list[int]) -> torch.Tensor:
    """(T, T) bool: [i, j] when node j is node i or one of its ancestors."""
    size = len(parents)
    seen = torch.eye(size, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            seen[node] |= seen[parent]
    return seen


def depth_first(parents: list[int]) -> list[int]:
    """The nodes in depth-first order, each node's children in node order: the first-child chain comes first, so a
    branch accepted along it lies in the cache's first places (its commit moves nothing: `CachedModel.keep_path`)."""
    children = children_of(parents)
    order: list[int] = []
    pending = list(reversed(children.get(-1, [])))
    while pending:
        node = pending.pop()
        order.append(node)
        pending.extend(reversed(children.get(node, [])))
    return order


def first_child_chain(parents: list[int]) -> list[int]:
    """The path that always takes the first child: the tree's main line, as a chain."""
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while children.get(node):
        node = children[node][0]
        path.append(node)
    return path


def greedy_tree_verdict(draft_ids: list[int], parents: list[int], target_logits: torch.Tensor) -> TreeVerdict:
    """target_logits: (T+1, V_target); row 0 scores the token after the sequence, row i+1 the token
    after node i's path."""
    target_argmax = argmax_ids(target_logits)  # (T+1,)

    def choose(node: int, kids: list[int]) -> tuple[int | None, int | None]:
        wanted = target_argmax[node + 1]
        return next((child for child in kids if draft_ids[child] == wanted), None), wanted

    return _walk(parents, choose)


def sampling_tree_verdict(
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    parents: list[int],
    target_probs: "torch.Tensor | Callable[[int], torch.Tensor]",
    generator: torch.Generator,
) -> TreeVerdict:
    """draft_probs: (T, V_draft), row i the distribution node i was drawn from, or None when every node
    was chosen deterministically (point masses); target_probs: (T+1, V_target), rows as in
    `greedy_tree_verdict`, or a function giving row i of it (the decoder computes only the rows the walk
    reaches: a few of a tree's T+1, each 152k wide on the demo target)."""
    target_row = target_probs if callable(target_probs) else target_probs.__getitem__
    draft_probs = None if draft_probs is None else draft_probs.float().cpu()

    def choose(node: int, kids: list[int]) -> tuple[int | None, int | None]:
        residual = target_row(node + 1).float().cpu()
        width = residual.shape[-1]
        for child in kids:
            token = draft_ids[child]
            draft_row = _draft_row(token, draft_probs, child, width)
            p_token = float(residual[token]) if token < width else 0.0
            q_token = float(draft_row[token]) if token < width else 1.0
            if float(torch.rand(1, generator=generator)) * q_token < p_token:
                return child, None
            residual = next_residual(residual, draft_row)
        return None, sample(residual, generator)

    return _walk(parents, choose)


def _walk(parents: list[int], choose) -> TreeVerdict:
    """Walk down from the sequence: at each node `choose(node, its children)` gives (the accepted child,
    None) or (None, the target's own next token), which ends the walk."""
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while True:
        kids = children.get(node, [])
        accepted, next_token = choose(node, kids)
        if accepted is None:
            return TreeVerdict(path, next_token, not kids)
        path.append(accepted)
        node = accepted


def next_residual(residual: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """The target's distribution left after a child drawn from `draft_row` was rejected:
    normalise(max(0, residual - draft_row)). (V,) -> (V,)."""
    left = (residual - draft_row).clamp_min(0.0)
    total = left.sum()
    if total <= 0:  # only through float round-off (residual == draft_row never rejects): keep it
        return residual
    return left / total

