"""A token-tree drafter over any draft model: where the draft hesitates it proposes several candidates.

The tree grows one level per draft forward. The first forward scores the token after the sequence and
its top `branching` tokens become the roots. Then, level by level, the most probable nodes of the newest
level (by the draft's cumulative probability of their path) are fed to the draft in ONE forward under a
tree mask (`CachedModel.extend_tree`), as many as the remaining node budget can give `branching`
children each, and each gets its children, most probable parent first, until `budget` nodes are drafted
(possibly in the middle of a level) or the depth limit is reached. The depth limit is the policy's k (and
`max_depth`): a step emits at most depth + 1 tokens.

Children: greedy decoding takes each node's top-`branching` tokens; sampling draws `branching` distinct
children from the draft's distribution (shaped like the target's), each from that distribution less the
siblings drawn before it, and reports for each the distribution it was drawn from, as multi-candidate
rejection needs (see engine/tree.py: a sibling is accepted with min(1, r/q) against the residual r its
elder siblings' rejections left, q being its own distribution; that stays exact whatever each q is, since a
rejection leaves a residual that does not depend on the rejected id). Drawn i.i.d. instead, a second child
would often repeat the first at the chat defaults, and a repeat can never be accepted: its id's residual is 0 once
its twin was rejected. Should two siblings still name the same id, the second is never expanded: its subtree would
repeat its twin's.

After the step, `update` keeps the accepted branch's entries in the draft's cache (`keep_path`). With a
`window` the draft reads only the window's tokens of the sequence (window.py), as the model drafter does.

How many nodes: a tree pays while verifying it costs about what verifying one token does. Given the
target's forward costs measured on this machine (`specdec calibrate`), `budget_from_costs` takes the tokens a forward
holds before its cost passes FLAT_RATIO times a one-token forward's; when not even a tree of MIN_BUDGET nodes
stays flat, the budget is MIN_BUDGET (the smallest tree: a measured curve that is not flat says a large one
costs most); without a measurement it is DEFAULT_BUDGET.

Grown by value (the policy's `DraftRule` has a `branch_cut`, as k = auto's cost model gives it): the shape then
follows the draft's odds instead of a fixed budget (`budget` only caps the nodes). Each frontier node gets its most
probable child, and further children (up to `branching`, VALUE_BRANCHING unless told) where the odds of their path —
the parent's path odds times the child's probability, which the draft's probabilities estimate well (the replay in
README) — reach the cut: what one more node adds to the verify, in the tokens it must return. A level is drafted on
(its nodes fed to the next level's forward) where its most probable node's path odds reach the rule's
`min_survival`, exactly as a chain drafts its next token; its other nodes ride in that forward where their odds
reach the rule's `feed_cut` (what a row more of the draft forward and its child's verify cost, in tokens; without
one, `min_survival` too). So without branches the tree is the chain the model drafter drafts, and the branches go
where the draft hesitates. Sampling decides how many children a node gets from the draft's sorted probabilities
before it draws them, so each draw's distribution is known before it is made, as multi-candidate rejection needs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from specdec_cli.engine.context import context_length
from specdec_cli.engine.draft import EMPTY_DRAFT, Draft, DraftRule, Drafter
from specdec_cli.drafters.subset_head import subset_head, with_prompt_path
from specdec_cli.drafters.window import DraftWindow
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.sampling import draft_odds, logits_to_probs, nonzero_ids, top_k
from specdec_cli.engine.tree import children_of

if TYPE_CHECKING:
    from specdec_cli.engine.sampling import SamplingParams

DEFAULT_BUDGET = 16
VALUE_BUDGET = 32  # the most nodes a tree grown by value holds (its verify forward's width)
MIN_BUDGET = 2  # the smallest tree there is (two siblings, or a chain of two)
DEFAULT_BRANCHING = 2
VALUE_BRANCHING = 4  # grown by value: up to this many children a node, as many as the branch cut lets in
# "About as much as one token": a verify forward that costs more than this times a one-token forward no longer
# hides the extra nodes.
FLAT_RATIO = 1.2


def budget_from_costs(seconds: Mapping[int, float], flat_ratio: float = FLAT_RATIO) -> int | None:
    """Tree nodes from a forward-cost curve ({n: seconds of a forward of n new tokens}, as `specdec
    calibrate` measured it): the most tokens a verify forward takes while it costs at most `flat_ratio` x a
    one-token forward (the largest measured count within it, linear towards the next, never past the largest
    measured), less the one sequence token the verify feeds too, and never below MIN_BUDGET (a curve that is
    not flat even for that says every extra node costs: falling back to DEFAULT_BUDGET there would make the
    tree slower than the target alone). None when the curve says nothing (no n = 1, nothing past it)."""
    curve = sorted((int(n), float(cost)) for n, cost in seconds.items() if cost > 0)
    one = dict(curve).get(1)
    if one is None or len(curve) < 2:
        return None
    flat_tokens = float(curve[-1][0])
    # From the largest count down: the last measured count still within the ratio (a noisy bump at a
    # smaller count, as timing 2 tokens often shows, does not end the flat stretch), then part of the way
    # to the next one.
    within = [index for index, (_, cost) in enumerate(curve) if cost <= flat_ratio * one]
    last = max(within)
    if last + 1 < len(curve):
        (n_before, cost_before), (n, cost) = curve[last], curve[last + 1]
        reach = (flat_ratio * one - cost_before) / (cost - cost_before)  # 0..1 of the way to n
        flat_tokens = n_before + max(0.0, reach) * (n - n_before)
    nodes = math.floor(flat_tokens + 1e-9) - 1  # 1e-9: 2.9999999 tokens from float round-off are 3
    return max(nodes, MIN_BUDGET)


class TreeDrafter(Drafter):
    name = "tree"

    def __init__(self, model: torch.nn.Module, budget: int = DEFAULT_BUDGET, branching: int | None = None,
                 max_depth: int = 12, window: int | None = None, token_ids: torch.Tensor | None = None,
                 share_head: bool = False) -> None:
        """token_ids, share_head: the draft scores only this subset of the vocabulary, as the model drafter's
        (subset_head.py; lossless: a node is always a subset id, the target may still emit any). branching: children a
        node (None: DEFAULT_BRANCHING with a fixed budget, up to VALUE_BRANCHING grown by value)."""
        if budget < 1 or (branching is not None and branching < 1) or max_depth < 1:
            raise ValueError(f"need budget, branching and max_depth >= 1, got {budget}, {branching}, {max_depth}")
        self.head = subset_head(model, token_ids.cpu() if token_ids is not None else None, share_head)
        self.runner = CachedModel(with_prompt_path(self.head or model, model))
        self.context = context_length(model)
        self.window = DraftWindow(window)  # what the draft model reads of the sequence (window.py)
        self.budget = budget
        self.branching = branching or DEFAULT_BRANCHING  # children a node, in a tree of a fixed budget
        self.value_branching = branching or VALUE_BRANCHING  # at most, grown by value
        self.max_depth = max_depth
        self.rule: DraftRule | None = None  # with a branch_cut: grown by value (module docstring)
        self._proposed: tuple[int, list[int], list[int]] | None = None  # (len(ids), tree ids, parents)

    def propose(
        self, ids: Sequence[int], k: int, params: "SamplingParams", generator: torch.Generator
    ) -> Draft:
        self._proposed = None
        depth_limit = min(k, self.max_depth)
        if depth_limit <= 0:
            return EMPTY_DRAFT
        sequence = self.window.seen(ids)
        tree_ids: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []     # per node: the distribution it was drawn from
        scores: list[float] = []          # per node: the draft's log probability of its path
        self.runner.prefill(sequence[:-1])  # a long unread part: through the draft's prompt path, where it has one
        frontier, frontier_logits = [-1], self.runner.extend(sequence, 1)  # (1, V)
        for depth in range(depth_limit):
            level = self._grow_level(frontier, frontier_logits, tree_ids, parents, rows, scores, params, generator)
            room = self.budget - len(tree_ids)
            if depth + 1 == depth_limit or room <= 0 or not level:
                break
            expandable = sorted(_first_of_twins(level, tree_ids, parents), key=lambda node: -scores[node])
            if self.grows_by_value:  # drafted on where the path's odds say so, as a chain's next token
                frontier = self._fed(expandable[:room], scores)
            else:
                frontier = sorted(expandable[: math.ceil(room / self.branching)])
            if not frontier:
                break
            frontier_logits = self.runner.extend_tree(sequence, tree_ids, parents, feed=frontier)  # (F, V)
        self._proposed = (len(sequence), tree_ids, parents)
        probs = None if params.greedy else torch.stack(rows)  # (T, V_draft)
        # A tree without branches is a chain: verified as one (the target's plain forward, no tree mask to build or
        # paths to keep); the draft's cache keeps its nodes until `update` as for a tree.
        chain = parents == list(range(-1, len(parents) - 1))
        return Draft(tree_ids, probs, None if chain else parents)

    def _grow_level(self, frontier: list[int], frontier_logits: torch.Tensor, tree_ids: list[int],
                    parents: list[int], rows: list[torch.Tensor], scores: list[float],
                    params: "SamplingParams", generator: torch.Generator) -> list[int]:
        """Give the frontier nodes their children, most probable node first, within the budget; returns
        the new nodes."""
        level: list[int] = []
        by_score = sorted(range(len(frontier)), key=lambda i: -scores[frontier[i]] if frontier[i] >= 0 else 0.0)
        width = self.value_branching if self.grows_by_value else self.branching  # children a node, at most
        for i in by_score:
            room = self.budget - len(tree_ids)
            if room <= 0:
                break
            logits = frontier_logits[i].float().cpu()
            odds = draft_odds(logits, params)  # what the path odds read (the model drafter's docstring says why)
            probs = odds if params.greedy else logits_to_probs(logits, params)  # what sampling draws from
            parent = frontier[i]
            base = scores[parent] if parent >= 0 else 0.0
            top_odds, top_ids = top_k(odds, min(width, odds.shape[-1]))
            count = min(self._children(top_odds.tolist(), base), room)
            if params.greedy:
                children = top_ids[:count].tolist()
                child_rows = [probs] * count
            else:
                children, child_rows = _draw_distinct(probs, count, generator)
            for index, row in zip(children, child_rows):
                tree_ids.append(self.head.token_id(index) if self.head is not None else int(index))
                parents.append(parent)
                rows.append(row if params.greedy or self.head is None else self.head.on_full_vocabulary(row))
                scores.append(base + math.log(max(float(odds[index]), 1e-30)))
                level.append(len(tree_ids) - 1)
        return level

    @property
    def grows_by_value(self) -> bool:
        """The policy's rule has a branch cut: the tree's shape follows the draft's odds (module docstring)."""
        return self.rule is not None and self.rule.branch_cut is not None

    def _fed(self, expandable: list[int], scores: list[float]) -> list[int]:
        """Grown by value, the nodes of a level (most probable first) that the next draft forward takes: none unless
        the first one's path odds reach the rule's `min_survival` (it pays for the forward, as a chain's next token
        does); then each whose odds reach the `feed_cut` (a row more of that forward), by default the same."""
        survival = math.log(max(self.rule.min_survival, 1e-30))
        if not expandable or scores[expandable[0]] < survival:
            return []
        cut = survival if self.rule.feed_cut is None else math.log(max(self.rule.feed_cut, 1e-30))
        return sorted(node for node in expandable if scores[node] >= min(cut, survival))

    def _children(self, top: list[float], parent_score: float) -> int:
        """How many children a node gets, given its `branching` largest probabilities (sorted) and its path's log
        odds `parent_score`: all of them; grown by value, the most probable and each further one whose path odds
        reach the rule's branch cut (read from the probabilities, not from draws)."""
        if not self.grows_by_value:
            return len(top)
        cut = math.log(max(self.rule.branch_cut, 1e-30)) - parent_score
        return 1 + sum(1 for p in top[1:] if math.log(max(p, 1e-30)) >= cut)

    def obey(self, rule: DraftRule) -> None:
        self.rule = rule

    def context_length(self) -> int | None:
        return self.context

    def update(self, ids: Sequence[int], drafted: int, accepted: int) -> None:
        """Keep the draft's entries for the branch that `ids` took through the proposed tree."""
        if self._proposed is None:
            return
        start, tree_ids, parents = self._proposed  # start: in the window's tokens
        self._proposed = None
        ids = self.window.within(ids)
        if ids is None or len(self.runner) != start or self.runner.shared_prefix(ids) < start:
            return  # the cache does not hold this step's prefix; its next forward crops it
        children, cached = children_of(parents), set(self.runner.tree_nodes)
        path: list[int] = []
        node = -1
        for token in ids[start:]:
            matches = [child for child in children.get(node, []) if tree_ids[child] == token]
            if not matches:
                break
            node = next((child for child in matches if child in cached), matches[0])
            path.append(node)
        self.runner.keep_path(path)

    def reset(self) -> None:
        self.runner.reset()
        self.window.reset()
        self._proposed = None


def _draw_distinct(probs: torch.Tensor, count: int, generator: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """Up to `count` distinct ids drawn one after the other, each from `probs` less the ids drawn before it
    (renormalised), and that distribution for each: what multi-candidate rejection must divide by (module
    docstring). Drawn among the ids with mass only (torch.multinomial over a whole vocabulary row is
    slow)."""
    with_mass = nonzero_ids(probs)
    count = min(count, len(with_mass))
    children = with_mass[torch.multinomial(probs[with_mass], count, replacement=False, generator=generator)].tolist()
    rows = [probs]
    for drawn in children[:-1]:
        remaining = rows[-1].clone()
        remaining[drawn] = 0.0
        rows.append(remaining / remaining.sum())
    return children, rows


def _first_of_twins(level: list[int], tree_ids: list[int], parents: list[int]) -> list[int]:
    """The level's nodes less repeated siblings (same parent, same token) after the first."""
    seen: set[tuple[int, int]] = set()
    kept = []
    for node in level:
        key = (parents[node], tree_ids[node])
        if key not in seen:
            seen.add(key)
            kept.append(node)
    return kept
