"""Python overhead of a speculative step: the wall time of a step that is not spent inside a model
forward, as a share of one verification forward.

    python scripts/step_overhead.py [--profile demo] [--drafter cascade] [--k auto] [--prompts 3] [--max-new-tokens 96]
                                    [--temperature 0.7]   (sampling, with the profile's top-p and top-k; 0: greedy)
                                    [--row-kernels-ab]    (each prompt twice: sampling's C row kernels, then torch's)
                                    [--json out.json]     (the per-prompt and total overheads, with the machine: CPU flags, versions)

Forward hooks on the target's and the draft's top-level modules (the draft's subset head where the drafter
scores a subset of the vocabulary, as the demo's does) time every forward; everything
else in a step (drafting logic, acceptance, cache bookkeeping, the policy) is overhead. Prints the
overhead per step in ms and in % of the mean target forward, and the Python functions with the
most own time outside the models (cProfile)."""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from specdec_cli.engine import SamplingParams, sampling
from specdec_cli.models.calibrate import machine
from specdec_cli.session import build_decoder, encode_chat
from specdec_cli.settings import ModelOverrides, choose_models, load_choice, parse_k

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared/prompts/spec_bench_questions.jsonl"


class ForwardClock:
    """Sums the seconds spent inside a module's forward (top level only)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.seconds = 0.0
        self.calls = 0
        self._started = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_args) -> None:
        self._started = time.perf_counter()

    def _post(self, *_args) -> None:
        self.seconds += time.perf_counter() - self._started
        self.calls += 1


def subset_head_clocks(draft, clocks: list[ForwardClock]) -> list[ForwardClock]:
    """Clocks for the draft's subset heads (drafters/subset_head.py) not clocked yet: a drafter that scores a
    subset of the vocabulary calls its SubsetHeadLM, never the draft's top-level model."""
    if draft is None:
        return []
    clocked = {id(clock.module) for clock in clocks}
    heads = draft.model.__dict__.get("_specdec_subset_heads", {}).values()
    return [ForwardClock(head) for head in heads if id(head) not in clocked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--k", default="auto")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--row-kernels-ab", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    choice = choose_models(ModelOverrides(profile=args.profile, drafter=args.drafter, draft_int8=args.draft_int8))
    target, draft = load_choice(choice)
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()]
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for q in questions[:: 40][: args.prompts]]
    clocks = [ForwardClock(target.model)] + ([ForwardClock(draft.model)] if draft else [])
    profiler = cProfile.Profile()
    params = (SamplingParams(args.temperature, choice.profile.top_k, choice.profile.top_p, seed=0)
              if args.temperature else SamplingParams())
    installed = sampling._row_kernels
    runs = [(prompt, kernels) for prompt in prompts for kernels in ((installed, None) if args.row_kernels_ab else
                                                                     (installed,))]
    totals: dict[str, list[float]] = {}
    records: list[dict] = []
    for prompt, kernels in runs:
        sampling.use_row_kernels(kernels)
        decoder = build_decoder(target, draft, choice.drafter, parse_k(args.k))
        clocks += subset_head_clocks(draft, clocks)
        stream = decoder.stream(prompt, params, args.max_new_tokens)
        next(stream)  # the first step also prefills: not a typical step
        for clock in clocks:
            clock.seconds, clock.calls = 0.0, 0
        started = time.perf_counter()
        profiler.enable()
        steps = sum(1 for _event in stream)
        profiler.disable()
        wall = time.perf_counter() - started
        forward_seconds = sum(clock.seconds for clock in clocks)
        target_forward = clocks[0].seconds / max(clocks[0].calls, 1)
        per_step = (wall - forward_seconds) / max(steps, 1)
        label = "" if not args.row_kernels_ab else (" (C row kernels)" if kernels else " (torch)")
        overhead = totals.setdefault(label, [0.0, 0])
        overhead[0] += wall - forward_seconds
        overhead[1] += steps
        records.append({"prompt": prompts.index(prompt), "label": label.strip(" ()") or "as installed",
                        "steps": steps, "wall_seconds": wall, "forward_seconds": forward_seconds,
                        "overhead_ms_per_step": 1000 * per_step, "target_forward_ms": 1000 * target_forward})
        print(f"prompt{label}: {steps} steps after the prefill, forwards {forward_seconds:.2f}s of {wall:.2f}s")
        print(f"  overhead {1000 * per_step:.2f} ms/step = {100 * per_step / target_forward:.1f}% of a target "
              f"forward ({1000 * target_forward:.0f} ms)")
    sampling.use_row_kernels(installed)
    for label, (seconds, steps) in totals.items():
        print(f"all prompts{label}: overhead {1000 * seconds / max(steps, 1):.2f} ms/step over {steps} steps")
    if args.json:
        summary = {label.strip(" ()") or "as installed": {"overhead_ms_per_step": 1000 * seconds / max(steps, 1),
                                                          "steps": steps} for label, (seconds, steps) in totals.items()}
        Path(args.json).write_text(json.dumps({"command": sys.argv, "machine": machine(),
                                               "temperature": args.temperature, "summary": summary, "runs": records},
                                              indent=1))
    print("\nPython functions with the most own time (all prompts, forwards included):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
