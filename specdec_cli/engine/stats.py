"""The one shape of a generation's numbers: counts per step, summed over steps, merged over runs.

Chat replies, `run` records and summaries, and `compare` runs all count with `GenerationStats`;
rates (acceptance, tokens per step, tokens per second) are derived here and nowhere else. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec_cli.engine.events import StepEvent

_SUMMED = ("new_tokens", "steps", "drafted", "accepted", "seconds", "draft_seconds", "verify_seconds", "held_steps",
           "lookup_steps", "lookup_drafted", "lookup_accepted", "tree_steps", "tree_nodes", "tree_accepted")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafted_at: list[int] = field(default_factory=list)   # drafted_at[i]: steps that drafted position i+1
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: steps that kept position i+1
    lookup_steps: int = 0     # steps whose draft was free (a lookup); included in the totals above
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    tree_steps: int = 0       # steps that verified a token tree; included in the totals above
    tree_nodes: int = 0       # their nodes (drafted counts them too)
    tree_accepted: int = 0    # their accepted depths, summed (accepted counts them too)
    # Per place in the tree ("0.1": the first root's second child, see tree.addresses):
    # [steps whose tree had it, steps its parent was accepted (or it is a root), steps it was accepted].
    tree_places: dict[str, list[int]] = field(default_factory=dict)
    held_steps: int = 0       # steps the policy kept from drafting because drafting measured slower than not
    policy: str | None = None  # why, the last time it did (the measurement), else None

    @property
    def drafted_steps(self) -> int:
        """Steps that drafted at least one token (model or lookup)."""
        return self.drafted_at[0] if self.drafted_at else 0

    def hold(self, reason: str | None) -> None:
        """Count a step the policy kept from drafting, and why."""
        self.held_steps += 1
        self.policy = reason or self.policy

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted; 0.0 when nothing was drafted (see `drafted` to tell the two apart)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def acceptance_at(self, positions: int) -> list[float | None]:
        """Acceptance at draft positions 1..positions (None where that position was never drafted)."""
        drafted, accepted = _padded(self.drafted_at, positions), _padded(self.accepted_at, positions)
        return [kept / tried if tried else None for kept, tried in zip(accepted, drafted)]

    def add_step(self, event: StepEvent) -> None:
        self.new_tokens += len(event.tokens)
        self.steps += 1
        self.drafted += event.drafted
        self.accepted += event.accepted
        self.draft_seconds += event.draft_seconds
        self.verify_seconds += event.verify_seconds
        # A tree drafts position i once however many nodes sit at depth i.
        _grow(self.drafted_at, event.tree_depth if event.tree_nodes else event.drafted)
        _grow(self.accepted_at, event.accepted)
        if event.free and event.drafted:
            self.lookup_steps += 1
            self.lookup_drafted += event.drafted
            self.lookup_accepted += event.accepted
        if event.held:
            self.hold(event.held)
        if event.tree_nodes:
            self.tree_steps += 1
            self.tree_nodes += event.tree_nodes
            self.tree_accepted += event.accepted
            self._count_places(event.tree_addresses, event.tree_accepted_address)

    def _count_places(self, places, accepted: tuple[int, ...]) -> None:
        for place in places:
            counts = self.tree_places.setdefault(".".join(map(str, place)), [0, 0, 0])
            counts[0] += 1
            if place[:-1] == accepted[: len(place) - 1]:  # its parent was accepted, or it is a root
                counts[1] += 1
                counts[2] += place == accepted[: len(place)]

    def merge(self, other: GenerationStats) -> None:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count
        for place, counts in other.tree_places.items():
            self.tree_places[place] = [a + b for a, b in zip(self.tree_places.get(place, [0, 0, 0]), counts)]
        self.policy = other.policy or self.policy

    @classmethod
    def total(cls, parts) -> GenerationStats:
        """The merge of many (an iterable of GenerationStats)."""
        summed = cls()
        for part in parts:
            summed.merge(part)
        return summed

    def as_dict(self) -> dict:
        """The chat transcript's `stats` (and what `render.stats_line` shows)."""
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "seconds": round(self.seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "accepted_at_position": list(self.accepted_at),
            "drafted_at_position": list(self.drafted_at),
            "lookup_steps": self.lookup_steps,
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "tree_accepted": self.tree_accepted,
            "drafted_steps": self.drafted_steps,
            "held_steps": self.held_steps,
            "policy": self.policy,
        }


def _grow(counts: list[int], upto: int) -> None:
    """Count one more step at positions 1..upto."""
    counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


def _padded(counts: list[int], length: int) -> list[int]:
    return (list(counts) + [0] * length)[:length]
