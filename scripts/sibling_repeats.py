"""How often a sampled tree's second child repeats its first: the tree drafter of a git revision, on Spec-Bench
prompts at the demo profile's chat defaults (temperature 0.7, its top-p and top-k, seed 0), 128 new tokens each.

    python scripts/sibling_repeats.py [--base 752559f] [--prompts 8] [--json out.json]

752559f is the last revision whose tree drafter drew a node's children i.i.d. (a repeat can never be accepted:
its id's residual is 0 once its twin was rejected); later revisions draw distinct children, so they count 0."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kernel_ab import spec_bench_prompts
from policy_ab import base_and_demo_pair
from specdec_cli.engine import SamplingParams
from specdec_cli.models.calibrate import machine
from specdec_cli.session import build_decoder


def counting(drafter, counts: dict[str, int]):
    """`drafter.propose`, counting the nodes with two or more children and those whose second child repeats the first."""
    propose = drafter.propose

    def counted(*args, **kwargs):
        draft = propose(*args, **kwargs)
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(draft.parents or []):
            children.setdefault(parent, []).append(draft.ids[node])
        for tokens in children.values():
            if len(tokens) >= 2:
                counts["branching"] += 1
                counts["repeats"] += tokens[1] == tokens[0]
        return draft

    return counted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="752559f")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    base, choice, target, draft = base_and_demo_pair(args.base, "specdec_cli/drafters/tree.py", "base_tree")
    params = SamplingParams(0.7, choice.profile.top_k, choice.profile.top_p, seed=0)
    counts = {"branching": 0, "repeats": 0}
    for prompt in spec_bench_prompts(target.tokenizer, choice.profile.system, 13)[: args.prompts]:
        decoder = build_decoder(target, draft, "tree", "auto")
        drafter = decoder.drafter.model_drafter
        drafter.__class__ = base.TreeDrafter
        drafter.propose = counting(drafter, counts)
        list(decoder.stream(prompt, params, 128))
    print(f"{args.base}: the second child repeats the first at {counts['repeats']} of {counts['branching']} nodes "
          "with two or more children")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "base": args.base, "prompts": args.prompts,
                                               "temperature": 0.7, "top_p": params.top_p, "top_k": params.top_k,
                                               **counts}, indent=1) + "\n")


if __name__ == "__main__":
    main()
