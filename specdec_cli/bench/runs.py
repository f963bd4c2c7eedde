"""What `specdec compare` runs and records: the configurations, their order, the settings, and `Run`,
one configuration on one prompt — the raw measurement written to --json. No torch.

Order is a fairness rule: prompt-major, so drift (thermal, other processes) hits every configuration
alike, rotated by one per prompt so no configuration always runs first (`run_order`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec_cli.engine.stats import GenerationStats
from specdec_cli.errors import InputError

if TYPE_CHECKING:
    from specdec_cli.engine import SamplingParams, StepEvent

SCHEMA = "specdec.compare/1"
BASELINE, SPECDEC, HF_ASSISTED, HF_LOOKUP = "baseline", "specdec", "hf-assisted", "hf-lookup"
TARGET, DRAFT, PLAIN_DRAFT = "target", "draft", "plain draft"  # the roles of the loaded models
HF_LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens (HF's docs' value); max_matching_ngram_size stays HF's default, 2
WARMUP_TOKENS = 8
POSITIONS = 4  # acceptance is reported at draft positions 1..POSITIONS
FORWARD_TIMINGS = 5  # single-token forwards timed per model at warm-up, for the cost ratio c




@dataclass(frozen=True)
class Configuration:
    name: str
    kind: str  # BASELINE | SPECDEC | HF_ASSISTED | HF_LOOKUP
    drafter: str = "none"  # a name `session.build_decoder` knows; "none" for the baseline and HF
    k: int | str = 0
    assistant: str = DRAFT  # HF assisted: which loaded draft it is given (DRAFT or PLAIN_DRAFT)
    tree_budget: int | None = None  # the tree drafter's nodes per step (None: its default)


def configurations(drafters: Sequence[str], ks: Sequence[int | str], with_hf: bool, has_draft: bool,
                   plain_draft: str | None = None, tree_budgets: Sequence[int] = (),
                   tree_default: Callable[[int | str], int] | None = None) -> list[Configuration]:
    """The baseline, every drafter × k (k = 0 is the baseline itself; repeats dropped), then HF's peers
    (assisted generation only when there is a draft model). `plain_draft` names the quantisation that
    only specdec applies to the draft (int8): HF assisted then runs twice, with the draft as HF users
    load it and with ours, so that our quantisation lever is not credited to the engine."""
    chosen = [Configuration("target alone", BASELINE)]
    for drafter in dict.fromkeys(drafters):
        if drafter == "tree":  # one configuration per tree size (`tree_budgets`; none given: `tree_default(k)`)
            for budget in dict.fromkeys(tree_budgets or [None]):
                for k in (k for k in dict.fromkeys(ks) if k != 0):
                    nodes = budget or (tree_default(k) if tree_default else None)
                    chosen.append(Configuration(f"tree{nodes or ''} k={k}", SPECDEC, drafter, k, tree_budget=nodes))
            continue
        chosen += [Configuration(f"{drafter} k={k}", SPECDEC, drafter, k) for k in dict.fromkeys(ks) if k != 0]
    if with_hf and has_draft and plain_draft:
        chosen.append(Configuration("HF assisted", HF_ASSISTED, assistant=PLAIN_DRAFT))
        chosen.append(Configuration(f"HF assisted ({plain_draft} draft)", HF_ASSISTED))
    elif with_hf and has_draft:
        chosen.append(Configuration("HF assisted", HF_ASSISTED))
    if with_hf:
        chosen.append(Configuration(f"HF prompt lookup ({HF_LOOKUP_TOKENS})", HF_LOOKUP))
    return chosen


def run_order(n_prompts: int, repeats: int, n_configurations: int) -> list[tuple[int, int, int]]:
    """(prompt index, repeat, configuration index) in run order: prompt-major, rotated by one per trial."""
    order = []
    for trial, (prompt, repeat) in enumerate((p, r) for p in range(n_prompts) for r in range(repeats)):
        order += [(prompt, repeat, (trial + i) % n_configurations) for i in range(n_configurations)]
    return order


@dataclass
class Run:
    """One configuration on one prompt: the raw measurement written to --json."""

    configuration: str
    prompt_index: int
    repeat: int
    tokens: list[int]
    seconds: float
    steps: int  # target forwards (verification steps), the prefill included
    finish_reason: str
    working_bytes: int  # memory growth during the run (see MemoryProbe)
    drafted: int | None = None  # None: not reported (HF peers)
    accepted: int | None = None
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    prefill: dict | None = None  # the first step (the prompt's prefill): drafted, draft_seconds, verify_seconds, free,
    # seconds (wall time from the start until its tokens came) and tokens (how many it gave; older JSON lacks both)
    lookup_steps: int = 0  # steps whose draft was free (prompt lookup); included in steps/drafted/accepted
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    tree_steps: int = 0  # steps that verified a token tree, their nodes and accepted depths (GenerationStats')
    tree_nodes: int = 0
    tree_accepted: int = 0
    tree_places: dict[str, list[int]] = field(default_factory=dict)  # per place in the tree (GenerationStats')
    held_steps: int = 0  # steps the policy kept from drafting because drafting measured slower (GenerationStats')
    policy: str | None = None  # why, the last time it did

    @classmethod
    def from_stats(cls, configuration: str, tokens: list[int], stats: GenerationStats, finish_reason: str,
                   working_bytes: int, first: StepEvent, first_seconds: float) -> Run:
        """An engine run: its stats (timed), and the first step, which also prefilled the prompt and whose tokens
        came `first_seconds` after the start."""
        prefill = {"drafted": first.drafted, "draft_seconds": first.draft_seconds,
                   "verify_seconds": first.verify_seconds, "free": first.free, "seconds": first_seconds,
                   "tokens": len(first.tokens)}
        return cls(configuration, -1, -1, tokens, stats.seconds, stats.steps, finish_reason, working_bytes,
                   stats.drafted, stats.accepted, stats.drafted_at, stats.accepted_at, stats.draft_seconds,
                   stats.verify_seconds, prefill, stats.lookup_steps, stats.lookup_drafted, stats.lookup_accepted,
                   stats.tree_steps, stats.tree_nodes, stats.tree_accepted, stats.tree_places, stats.held_steps,
                   stats.policy)

    def stats(self) -> GenerationStats:
        """The run as the engine's stats (drafting counts 0 where not reported), to merge with others."""
        return GenerationStats(
            new_tokens=len(self.tokens), steps=self.steps, drafted=self.drafted or 0, accepted=self.accepted or 0,
            seconds=self.seconds, draft_seconds=self.draft_seconds or 0.0, verify_seconds=self.verify_seconds or 0.0,
            drafted_at=list(self.drafted_at), accepted_at=list(self.accepted_at), lookup_steps=self.lookup_steps,
            lookup_drafted=self.lookup_drafted, lookup_accepted=self.lookup_accepted, tree_steps=self.tree_steps,
            tree_nodes=self.tree_nodes, tree_accepted=self.tree_accepted,
            tree_places={place: list(counts) for place, counts in self.tree_places.items()},
            held_steps=self.held_steps, policy=self.policy,
        )


@dataclass
class BenchSettings:
    params: SamplingParams
    max_new_tokens: int
    repeats: int = 1
    system: str | None = None  # system prompt for single-turn prompts (chat template only)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise InputError(f"--repeats must be at least 1, got {self.repeats}", "pass a positive number")
