"""The numbers behind `specdec compare`'s tables: speedup over the baseline on the same runs, acceptance
by draft position, lossless counts, and the theory's expected speedup. Pure: `Run`s in, plain rows out.

Speedup is throughput over the baseline's on the same runs, (tokens/s) / (baseline tokens/s); when
the outputs are identical (greedy, lossless) that is the baseline's time over the configuration's.
Every sum over runs is `GenerationStats.merge`'s."""

from __future__ import annotations

import math
import statistics

from specdec_cli.bench.runs import POSITIONS, Configuration, Run
from specdec_cli.engine.policy import expected_tokens
from specdec_cli.engine.stats import GenerationStats


def expected_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al. (2023): expected speedup of speculative decoding over the target alone, for
    per-token acceptance rate `alpha`, draft length `gamma` and cost ratio `c` (one draft forward /
    one target forward): (1 - α^(γ+1)) / ((1 - α)(γc + 1)). At α = 1 it is the limit (γ + 1) / (γc + 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def identical_prompts(baseline: dict[tuple[int, int], list[int]], other: dict[tuple[int, int], list[int]]) -> tuple[int, int]:
    """(n, N): of the N prompts that both ran, how many gave exactly the baseline's tokens in every repeat.
    Keys are (prompt index, repeat)."""
    prompts: dict[int, bool] = {}
    for key in baseline.keys() & other.keys():
        prompts[key[0]] = prompts.get(key[0], True) and baseline[key] == other[key]
    return sum(prompts.values()), len(prompts)


def summary_row(config: Configuration, runs: list[Run], baseline: list[Run], greedy: bool, memory_bytes: int) -> dict:
    """The table row of one configuration over `runs` (and the baseline's runs on the same prompts)."""
    base = {(run.prompt_index, run.repeat): run for run in baseline}
    paired = [(run, base[(run.prompt_index, run.repeat)]) for run in runs if (run.prompt_index, run.repeat) in base]
    speedups = [_rate(run) / _rate(b) for run, b in paired if _rate(b) and _rate(run)]
    total = GenerationStats.total(run.stats() for run in runs)
    paired_baseline = GenerationStats.total(b.stats() for _, b in paired)
    overall = _ratio(_ratio(total.new_tokens, total.seconds), _ratio(paired_baseline.new_tokens, paired_baseline.seconds))
    identical = identical_prompts(
        {(b.prompt_index, b.repeat): b.tokens for _, b in paired}, {(r.prompt_index, r.repeat): r.tokens for r, _ in paired}
    ) if greedy else None
    row = {
        "configuration": config.name, "kind": config.kind, "drafter": config.drafter, "k": config.k,
        "prompts": len({run.prompt_index for run in runs}), "runs": len(runs),
        "new_tokens": total.new_tokens, "seconds": round(total.seconds, 4),
        "tokens_per_second": _ratio(total.new_tokens, total.seconds),
        "median_tokens_per_second": statistics.median(_rate(run) for run in runs) if runs else None,
        "speedup": overall,
        "speedup_min": min(speedups, default=None), "speedup_max": max(speedups, default=None),
        "tokens_per_step": _ratio(total.new_tokens, total.steps),
        "memory_bytes": memory_bytes + max((run.working_bytes for run in runs), default=0),
        "identical": identical[0] if identical else None, "compared": identical[1] if identical else None,
    }
    # a tree's size and its accepted depth, per tree step (None without trees)
    trees = {"tree_nodes_per_step": _ratio(total.tree_nodes, total.tree_steps),
             "tree_depth_per_step": _ratio(total.tree_accepted, total.tree_steps)}
    return (row | _drafting_fields(runs, total) | trees | _first_step_fields(paired)
            | {"theory": theory(runs, baseline, overall)})


def _first_step_fields(paired: list[tuple[Run, Run]]) -> dict:
    """The first step apart from the rest: its mean wall time (the prompt's prefill and the first tokens: the time
    to the first token of a plain decoder), and the decoding after it, tokens after the first step over the time after
    it (what llama.cpp's tg and a per-token latency measure), also over the baseline's on the same runs. None for runs
    that do not report their first step (HF's peers, an older JSON without the first step's seconds)."""
    if not paired or any(_first_step(run) is None or _first_step(b) is None for run, b in paired):
        return {"first_step_seconds": None, "decode_tokens_per_second": None, "decode_speedup": None}

    def decode_rate(runs: list[Run]) -> float | None:
        return _ratio(sum(len(run.tokens) - _first_step(run)[1] for run in runs),
                      sum(run.seconds - _first_step(run)[0] for run in runs))

    runs, baseline = [run for run, _ in paired], [b for _, b in paired]
    rate = decode_rate(runs)
    return {"first_step_seconds": statistics.fmean(_first_step(run)[0] for run in runs),
            "decode_tokens_per_second": rate, "decode_speedup": _ratio(rate, decode_rate(baseline))}


def _first_step(run: Run) -> tuple[float, int] | None:
    """(seconds until the first step's tokens came, how many it gave), or None where not recorded."""
    if run.prefill is None or "seconds" not in run.prefill:
        return None
    return run.prefill["seconds"], run.prefill["tokens"]


def _drafting_fields(runs: list[Run], total: GenerationStats) -> dict:
    """Acceptance and the draft/verify split; None for runs that do not report drafting (HF peers)."""
    if not runs or any(run.drafted is None for run in runs):
        return {"acceptance_rate": None, "acceptance_at": [None] * POSITIONS, "draft_share": None,
                "drafted_steps": None, "held_steps": None, "policy": None}
    drafting_seconds = total.draft_seconds + total.verify_seconds
    return {
        # the policy's choices: the share of steps that drafted, of those it held back, and its last reason
        "drafted_steps": _ratio(total.drafted_steps, total.steps),
        "held_steps": _ratio(total.held_steps, total.steps),
        "policy": total.policy,
        "acceptance_rate": _ratio(total.accepted, total.drafted),
        "acceptance_at": total.acceptance_at(POSITIONS),
        "draft_share": _ratio(total.draft_seconds, drafting_seconds) if total.drafted else None,
    }


def theory(runs: list[Run], baseline: list[Run], measured: float | None) -> dict | None:
    """The expected speedup from the run's own α, γ and c, and the efficiency measured / expected.

    Steps are of two sources. Model steps (a draft model's drafts, or none at all): α = accepted /
    drafted, γ = mean drafted per step, c = the seconds of drafting one token over the seconds of one
    baseline target step (both after the prefill step, measured in this run). Lookup steps (free drafts,
    c = 0) get their own α and γ. The expectation weighs each source's tokens per step and cost per step
    by its share of steps; without lookup steps it is Leviathan et al.'s formula. None when nothing
    was drafted."""
    if not runs or any(run.drafted is None for run in runs):
        return None
    total = GenerationStats.total(run.stats() for run in runs)
    if not total.drafted:
        return None
    if total.tree_steps:
        return tree_theory(runs, total, target_step_seconds(baseline), measured)
    model = _source(total.steps - total.lookup_steps, total.drafted - total.lookup_drafted,
                    total.accepted - total.lookup_accepted)
    lookup = _source(total.lookup_steps, total.lookup_drafted, total.lookup_accepted)
    model_drafted_after_prefill = sum(
        run.drafted - run.lookup_drafted - (0 if run.prefill.get("free") else run.prefill["drafted"]) for run in runs
    )
    draft_cost = _ratio(
        sum(run.draft_seconds - run.prefill["draft_seconds"] for run in runs if run.drafted > run.lookup_drafted),
        model_drafted_after_prefill,
    )
    target_step = target_step_seconds(baseline)
    if not target_step or (model["drafted"] and draft_cost is None):  # no decode-step cost to compare
        return None
    c = draft_cost / target_step if draft_cost is not None else 0.0
    steps = model["steps"] + lookup["steps"]
    tokens = sum(source["steps"] * source["tokens_per_step"] for source in (model, lookup))
    cost = model["steps"] * (model["gamma"] * c + 1) + lookup["steps"]
    expected = tokens / cost if steps else None
    efficiency = _ratio(measured, expected)
    return {
        "kind": "chain", "alpha": total.accepted / total.drafted, "gamma": total.drafted / total.steps,
        "c": c, "model": model, "lookup": lookup, "expected_speedup": expected, "efficiency": efficiency,
    }


def expected_tree_accepted(places: dict[str, list[int]], steps: int) -> float:
    """Expected accepted tokens per step from the acceptance per place in the tree (GenerationStats'
    `tree_places`: present, reached, accepted). A place p is accepted, once its parent was, at the rate
    a(p) = accepted / reached; a node at p is on the accepted path with chance Π a(q) over p and the
    places above it, and the accepted length counts the accepted nodes, so
    E[accepted] = Σ_p present(p) · Π_{q from the root to p} a(q) / steps."""
    rate = {place: accepted / reached if reached else 0.0 for place, (_, reached, accepted) in places.items()}
    expected = 0.0
    for place, (present, _, _) in places.items():
        ranks = place.split(".")
        expected += present * math.prod(rate.get(".".join(ranks[: depth + 1]), 0.0) for depth in range(len(ranks)))
    return expected / steps if steps else 0.0


def tree_theory(runs: list[Run], total: GenerationStats, target_step: float | None, measured: float | None
                ) -> dict | None:
    """Trees: expected = (1 + E[accepted]) / (c + 1), c = drafting seconds per step over one baseline target step
    (both after the prefill step), the verify forward taken as one target step. E[accepted] weighs each kind of
    step by its share of steps: a tree step by the run's own acceptance per place (`expected_tree_accepted`), the
    steps the tree drafter drafted as a chain (or not at all) and its lookup steps each by their α and γ (the chain
    theory's i.i.d. expectation). None without a step cost."""
    draft_step = _ratio(sum(run.draft_seconds - run.prefill["draft_seconds"] for run in runs),
                        sum(run.steps - 1 for run in runs))
    if not target_step or draft_step is None:
        return None
    c = draft_step / target_step
    lookup = _source(total.lookup_steps, total.lookup_drafted, total.lookup_accepted)
    chain = _source(total.steps - total.tree_steps - total.lookup_steps,
                    total.drafted - total.tree_nodes - total.lookup_drafted,
                    total.accepted - total.tree_accepted - total.lookup_accepted)
    in_trees = expected_tree_accepted(total.tree_places, total.tree_steps) * total.tree_steps
    besides = sum(source["steps"] * (source["tokens_per_step"] - 1) for source in (chain, lookup))
    accepted = (in_trees + besides) / total.steps
    expected = (1 + accepted) / (c + 1)
    return {"kind": "tree", "c": c, "nodes_per_step": total.tree_nodes / total.tree_steps,
            "tree_share": total.tree_steps / total.steps, "expected_accepted": accepted,
            "accepted": total.accepted / total.steps, "expected_speedup": expected,
            "efficiency": _ratio(measured, expected)}


def _source(steps: int, drafted: int, accepted: int) -> dict:
    """α, γ and the i.i.d. expectation of tokens per step of one source of drafts."""
    alpha = accepted / drafted if drafted else 0.0
    gamma = drafted / steps if steps else 0.0
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "alpha": alpha, "gamma": gamma,
            "tokens_per_step": expected_tokens(alpha, gamma)}


def target_step_seconds(baseline: list[Run]) -> float | None:
    """Mean seconds of one decoding step of the target alone, the prefill step left out."""
    decode_steps = sum(run.steps - 1 for run in baseline)
    decode_seconds = sum(run.verify_seconds - run.prefill["verify_seconds"] for run in baseline if run.prefill)
    return decode_seconds / decode_steps if decode_steps > 0 else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _rate(run: Run) -> float:
    return run.stats().tokens_per_second
