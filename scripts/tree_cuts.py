"""The tree's branch cut, measured: the default chain (cascade k=auto) against the tree grown by value (k=auto)
with the cost model's branch cut scaled by each factor given, interleaved prompt by prompt in one process on the
demo pair as `auto` loads it (13 Spec-Bench prompts, one per category, greedy, 128 new tokens). A factor of 100
leaves no branch (a cut above 0.95 odds is never reached): the tree is then the chain, through the tree drafter.

    python scripts/tree_cuts.py [--factors 0.5,1,2,100] [--json PATH]

Prints each prompt's tok/s per configuration (with tree nodes / tree steps) and the total tok/s of each
configuration against the chain's. Run on an idle machine."""

from __future__ import annotations

import argparse
import json
import time

from specdec_cli.engine import SamplingParams
from specdec_cli.engine.policy import DraftOrNot
from specdec_cli.models.calibrate import machine
from specdec_cli.session import build_decoder, encode_chat
from specdec_cli.settings import ModelOverrides, choose_models, load_choice

from levers import spec_bench  # scripts/levers.py: one Spec-Bench question per category


class ScaledCut(DraftOrNot):
    """The shipped policy with its branch cut times `factor` (capped at 0.95 as the policy caps it)."""

    factor = 1.0

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        if self.branch_cut is not None:
            self.branch_cut = min(0.95, self.branch_cut * self.factor)


def decoders(target, draft, factors: list[float]) -> dict:
    chosen = {"cascade (chain)": build_decoder(target, draft, "cascade", "auto")}
    for factor in factors:
        decoder = build_decoder(target, draft, "tree", "auto")
        shipped = decoder.policy
        policy = ScaledCut(max_k=shipped.max_k, rule=shipped.base_rule, verify_curve=shipped.verify_curve)
        policy.factor = factor
        decoder.set_drafting(decoder.drafter, policy)
        chosen[f"tree, cut x{factor:g}"] = decoder
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", default="0.5,1,2,100")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target, draft = load_choice(choose_models(ModelOverrides()))
    chosen = decoders(target, draft, [float(factor) for factor in args.factors.split(",")])
    warm = encode_chat(target.tokenizer, [{"role": "user", "content": "Hi"}])
    for decoder in chosen.values():
        decoder.reset()
        decoder.generate(warm, SamplingParams(), 8)
    runs, totals = [], {name: [0.0, 0] for name in chosen}
    for category, question in spec_bench(1):
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": question}])
        line = f"{category:14s}"
        for name, decoder in chosen.items():
            decoder.reset()
            start = time.perf_counter()
            result = decoder.generate(ids, SamplingParams(), args.max_new_tokens)
            seconds = time.perf_counter() - start
            totals[name][0] += seconds
            totals[name][1] += len(result.tokens)
            stats = result.stats
            line += f"  {name} {len(result.tokens) / seconds:5.1f} ({stats.tree_nodes}/{stats.tree_steps})"
            runs.append({"category": category, "configuration": name, "seconds": seconds, "tokens": result.tokens,
                         "steps": stats.steps, "drafted": stats.drafted, "accepted": stats.accepted,
                         "tree_steps": stats.tree_steps, "tree_nodes": stats.tree_nodes,
                         "tree_accepted": stats.tree_accepted})
        print(line, flush=True)
    chain_seconds, chain_tokens = totals["cascade (chain)"]
    summary = {}
    for name, (seconds, tokens) in totals.items():
        summary[name] = {"tokens_per_second": tokens / seconds,
                         "over_chain": (tokens / seconds) / (chain_tokens / chain_seconds)}
        print(f"{name:18s} {tokens / seconds:6.2f} tok/s  x{summary[name]['over_chain']:.3f} of the chain")
    identical = sum(1 for run in runs if run["tokens"] == next(
        other["tokens"] for other in runs if other["category"] == run["category"]))
    print(f"identical to the chain's output: {identical}/{len(runs)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine(), "target": target.precision, "draft": draft.precision,
                       "max_new_tokens": args.max_new_tokens, "summary": summary, "runs": runs}, handle, indent=1)


if __name__ == "__main__":
    main()
