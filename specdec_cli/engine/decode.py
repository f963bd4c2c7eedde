"""The speculative decoder: token ids in, token ids out. It knows nothing of text, files or terminals.

Each step, in order:
  1. draft    — the drafter proposes k tokens (k from the draft-length policy; k = 0 is plain decoding);
  2. verify   — one target forward over [last token, drafts] scores all k+1 positions;
  3. accept   — the acceptance rule keeps a prefix of the drafts and adds the target's own next token;
  4. trim     — stop at an EOS id or at max_new_tokens, whichever comes first;
  5. learn    — the policy and the drafter see how many drafts were accepted (lookups too: free to
                 draft, not to verify), and the drafter takes the policy's rule when it changed.
Caches are not cropped here: both models' `CachedModel.extend` cut their caches back to the accepted
sequence at the start of their next forward.

A tree draft (`Draft.parents` set, see tree.py) goes the same way with two differences: step 2 scores
every node in one forward under a tree mask (`CachedModel.extend_tree`), and after step 3 a commit
keeps exactly the accepted branch in the target's cache (`CachedModel.keep_path`, no re-forward; the
drafter commits its own cache in step 5). A target that cannot take a tree mask (`tree_capable`)
verifies the tree's first-child chain instead.

`SpeculativeDecoder.stream` yields one `StepEvent` per verification step; `generate` collects them.
Before the first forward, `fit` checks the prompt against the models' context: a prompt that leaves no
room raises PromptTooLongError, a budget past the context is cut to what fits (finish_reason "length")."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from specdec_cli.engine.acceptance import Verdict, greedy_verdict, sampling_verdict
from specdec_cli.engine.context import Budget, context_length, fit_budget, smallest_context
from specdec_cli.engine.draft import EMPTY_DRAFT, Draft, DraftRule, Drafter
from specdec_cli.engine.events import Provenance, StepEvent
from specdec_cli.engine.kv import CachedModel, tree_capable
from specdec_cli.engine.policy import DraftLengthPolicy, FixedK
from specdec_cli.engine.sampling import SamplingParams, logits_to_probs, make_generator
from specdec_cli.engine.stats import GenerationStats
from specdec_cli.engine.tree import (
    addresses, depth_first, depths, first_child_chain, greedy_tree_verdict, sampling_tree_verdict,
)


@dataclass
class GenerationResult:
    tokens: list[int]
    provenance: list[Provenance]
    finish_reason: str
    stats: GenerationStats
    budget: Budget  # max_new_tokens as asked and as the context let it be (budget.cut, budget.note())


StopCallback = Callable[[list[int]], bool]  # sees all generated ids so far; True ends generation


class SpeculativeDecoder:
    """Owns the target's cache, the drafter (None: target alone) and the draft-length policy. Keep one
    per conversation: caches are re-used across calls for whatever prefix the new prompt shares.
    reuse_prompts: the target computes each row alone (row-wise attention), so `reset` keeps its cache
    for the next prompt's shared prefix (see `reset`)."""

    def __init__(
        self,
        target: torch.nn.Module | CachedModel,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        eos_token_ids: Sequence[int] = (),
        reuse_prompts: bool = False,
    ) -> None:
        self.target = target if isinstance(target, CachedModel) else CachedModel(target)
        self.reuse_prompts = reuse_prompts
        self.verifies_trees = tree_capable(self.target.model)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.set_drafting(drafter, policy if policy is not None else FixedK(4 if drafter else 0))
        # what the target alone would hold cached now: the last sequence but its last token; None after a reset
        # that kept the cache (reuse_prompts)
        self._committed: int | None = 0

    def set_drafting(self, drafter: Drafter | None, policy: DraftLengthPolicy) -> None:
        """Draft with `drafter` (None: the target alone) as far as `policy` says. The policy owns how far:
        k each step, and its `rule` (when it has one) binds the drafter's stop rule, in place."""
        self.drafter = drafter
        self.policy = policy
        self._obeyed: DraftRule | None = None
        self._obey_policy()

    def _obey_policy(self) -> None:
        """Hand the drafter the policy's rule when it changed (a cost model re-chooses the lookup length)."""
        rule = self.policy.rule
        if self.drafter is not None and rule is not None and rule != self._obeyed:
            self.drafter.obey(rule)
            self._obeyed = rule

    @property
    def context(self) -> int | None:
        """The positions target and drafter both take (None: no limit known)."""
        drafter_context = self.drafter.context_length() if self.drafter is not None else None
        return smallest_context(context_length(self.target.model), drafter_context)

    def fit(self, prompt_tokens: int, max_new_tokens: int) -> Budget:
        """The budget a prompt of `prompt_tokens` leaves in the context; PromptTooLongError if none."""
        return fit_budget(prompt_tokens, max_new_tokens, self.context)

    def reset(self) -> None:
        """Forget all state a conversation built: learned draft lengths, the drafter's caches, and the target's
        cache, but where the target computes each row alone (`reuse_prompts`): there its entries stay, and a
        next prompt that shares a prefix with them (a system prompt) computes only the rest, which is bit for
        bit what computing all of it gives, so the next output still depends on its prompt alone."""
        if self.reuse_prompts:
            self.target.crop(len(self.target))  # an uncommitted tree's entries go
            self._committed = None  # the next prompt keeps what reading it alone would make (kv.py's `fresh`)
        else:
            self.target.reset()
            self._committed = 0
        if self.drafter is not None:
            self.drafter.reset()
        self.policy.reset()

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        stop: StopCallback | None = None,
    ) -> Iterator[StepEvent]:
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        max_new_tokens = self.fit(len(prompt_ids), max_new_tokens).max_new_tokens  # before any forward
        ids = list(prompt_ids)
        # A target with a prefill path reads the prompt but its last token through it (kv.py), from what the
        # target alone would hold, so that speculation and the target alone read it the same way.
        if self._committed is None:
            self.target.prefill(ids[:-1], fresh=True)
        else:
            self.target.prefill(ids[:-1], keep_at_most=self._committed)
        generated: list[int] = []
        generator = make_generator(params.seed)
        while len(generated) < max_new_tokens:
            event = self._step(ids, params, generator, max_new_tokens - len(generated), first=not generated)
            generated.extend(event.tokens)
            ids.extend(event.tokens)
            self._committed = len(ids) - 1
            if event.finish_reason is None and stop is not None and stop(generated):
                event = _with_finish(event, "stop")
            if event.finish_reason is None and len(generated) >= max_new_tokens:
                event = _with_finish(event, "length")
            yield event
            if event.finish_reason is not None:
                return

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                 stop: StopCallback | None = None) -> GenerationResult:
        """`stream`, collected: all tokens, their provenance, why it ended, and the stats (timed)."""
        tokens: list[int] = []
        provenance: list[Provenance] = []
        stats = GenerationStats()
        finish_reason = "length"
        budget = self.fit(len(prompt_ids), max_new_tokens)
        started = time.perf_counter()
        for event in self.stream(prompt_ids, params, budget.max_new_tokens, stop):
            tokens.extend(event.tokens)
            provenance.extend(event.provenance)
            stats.add_step(event)
            finish_reason = event.finish_reason or finish_reason
        stats.seconds = time.perf_counter() - started
        return GenerationResult(tokens, provenance, finish_reason, stats, budget)

    def _step(
        self, ids: list[int], params: SamplingParams, generator: torch.Generator, remaining: int,
        first: bool = False,
    ) -> StepEvent:
        started = time.perf_counter()
        # The policy's reason, when it keeps this step from drafting with the model (a lookup may still propose).
        held = self.policy.reason if self.drafter is not None and remaining > 1 and not self.policy.next_k() else None
        draft = self._draft(ids, params, generator, remaining)
        drafted_at = time.perf_counter()
        path: list[int] = []
        if draft.parents is None:
            verdict = self._verify(ids, draft, params, generator)
            accepted_ids = draft.ids[: verdict.accepted]
        else:
            path, verdict = self._verify_tree(ids, draft, params, generator)
            self.target.keep_path(path)  # commit: the target's cache keeps exactly the accepted branch
            accepted_ids = [draft.ids[node] for node in path]
        verified_at = time.perf_counter()
        tokens = accepted_ids + [verdict.next_token]
        provenance = [Provenance.ACCEPTED] * verdict.accepted + [provenance_of_next(draft, verdict)]
        tokens, provenance, finish_reason = trim_step(tokens, provenance, remaining, self.eos_token_ids)
        draft_seconds, verify_seconds = drafted_at - started, verified_at - drafted_at
        tree_depth = _depth(draft)
        # The first step also prefills the prompt: its seconds say nothing of a step's cost.
        timed = (None, None) if first else (draft_seconds, verify_seconds)
        self.policy.update(tree_depth or len(draft), verdict.accepted, *timed, free=draft.free)
        if self.drafter is not None:
            self.drafter.update(ids + tokens, len(draft), verdict.accepted)
        places = tuple(addresses(draft.parents)) if draft.parents is not None else ()
        return StepEvent(
            tokens, provenance, len(draft), verdict.accepted, draft_seconds, verify_seconds, finish_reason,
            draft.free, len(places), tree_depth, places, places[path[-1]] if path else (), held,
        )

    def _draft(
        self, ids: list[int], params: SamplingParams, generator: torch.Generator, remaining: int
    ) -> Draft:
        # A step emits at most k + 1 tokens: drafting past what may still be emitted is wasted work.
        k = min(self.policy.next_k(), remaining - 1)
        if self.drafter is None or remaining <= 1:
            return EMPTY_DRAFT
        self._obey_policy()
        # Called with k = 0 too: a drafter with a free source (the cascade's lookup) may still propose.
        draft = self.drafter.propose(ids, k, params, generator)
        if draft.parents is not None:
            return _tree_within(draft, remaining - 1, self.verifies_trees)
        if len(draft) > remaining - 1:
            draft = Draft(draft.ids[: remaining - 1], None if draft.probs is None else draft.probs[: remaining - 1],
                          free=draft.free)
        return draft

    def _verify(
        self, ids: list[int], draft: Draft, params: SamplingParams, generator: torch.Generator
    ) -> Verdict:
        target_logits = self.target.extend(ids + draft.ids, len(draft) + 1)  # (k+1, V_target)
        if params.greedy:
            return greedy_verdict(draft.ids, target_logits)
        target_probs = logits_to_probs(target_logits, params)
        return sampling_verdict(draft.ids, draft.probs, target_probs, generator)

    def _verify_tree(
        self, ids: list[int], draft: Draft, params: SamplingParams, generator: torch.Generator
    ) -> tuple[list[int], Verdict]:
        """One target forward over every node; the accepted path (node indices) and its verdict."""
        target_logits = self.target.extend_tree(ids, draft.ids, draft.parents, sequence_logits=True)  # (T+1, V)
        if params.greedy:
            tree_verdict = greedy_tree_verdict(draft.ids, draft.parents, target_logits)
        else:
            def target_row(row: int) -> torch.Tensor:  # only the rows the walk reaches
                return logits_to_probs(target_logits[row], params)

            tree_verdict = sampling_tree_verdict(draft.ids, draft.probs, draft.parents, target_row, generator)
        return tree_verdict.path, Verdict(len(tree_verdict.path), tree_verdict.next_token, tree_verdict.is_bonus)

def trim_step(
    tokens: list[int], provenance: list[Provenance], remaining: int, eos_token_ids
) -> tuple[list[int], list[Provenance], str | None]:
    """A step's tokens cut after the first EOS id ("stop") or at the token budget ("length")."""
    end = eos_end(tokens[:remaining], eos_token_ids)
    if end is not None:
        return tokens[:end], provenance[:end], "stop"
    if len(tokens) >= remaining:
        return tokens[:remaining], provenance[:remaining], "length"
    return tokens, provenance, None


def eos_end(tokens: Sequence[int], eos_token_ids) -> int | None:
    """How many tokens to keep to end right after the first EOS id; None when there is none."""
    for position, token in enumerate(tokens):
        if token in eos_token_ids:
            return position + 1
    return None


def cut_at_eos(tokens: list[int], eos_token_ids) -> list[int]:
    """The tokens up to and including the first EOS id (all of them when there is none), as a step keeps them."""
    end = eos_end(tokens, eos_token_ids)
    return tokens if end is None else tokens[:end]


def provenance_of_next(draft: Draft, verdict: Verdict) -> Provenance:
    if not draft.ids:
        return Provenance.TARGET
    return Provenance.BONUS if verdict.is_bonus else Provenance.RESAMPLED


def _with_finish(event: StepEvent, reason: str) -> StepEvent:
    return replace(event, finish_reason=reason)


def _depth(draft: Draft) -> int:
    """A tree draft's deepest path in tokens; 0 for a chain."""
    return 1 + max(depths(draft.parents), default=-1) if draft.parents is not None else 0


def _tree_within(draft: Draft, max_depth: int, as_tree: bool) -> Draft:
    """The tree cut to paths of at most `max_depth` tokens (a step emits at most depth + 1), its nodes in
    depth-first order (siblings keep their order: `depth_first`), or, for a target that cannot verify a tree, its
    first-child chain cut the same way."""
    node_depths = depths(draft.parents)
    if as_tree:
        nodes = [node for node in depth_first(draft.parents) if node_depths[node] < max_depth]
    else:
        nodes = first_child_chain(draft.parents)[:max_depth]
    renumbered = {node: i for i, node in enumerate(nodes)}
    parents = [renumbered.get(draft.parents[node], -1) for node in nodes] if as_tree else None
    probs = None if draft.probs is None else draft.probs[nodes]
    return Draft([draft.ids[node] for node in nodes], probs, parents, draft.free)
