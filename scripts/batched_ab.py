"""The batched engine (`engine/batched.py`, what `run --batch-size B` runs) of a git revision against the working
tree's, on whole batches, interleaved in one process: the same models and requests, only that module differs.

    python scripts/batched_ab.py [--base HEAD] [--batch-size 2] [--temperature 0.7] [--prompts 13] [--repeats 2]
                                 --json benchmarks/....json

The first question of each Spec-Bench category (as `compare` encodes it), 128 new tokens each, the demo pair with
the cascade at k = auto (`run`'s default), greedy unless --temperature (then the profile's top-p and top-k, seed
0 for every request). Each repeat runs the target alone once, then both versions in turn (the order alternating
per repeat), a fresh decoder each time. The batched engine's draft lengths come from the forward-cost curves and
the rows' acceptance, never the clock, so a greedy run must give the target's tokens both ways and a sampled run
compares rates and acceptance only. Prints tokens/s, the ratio to the target alone, drafted and accepted tokens."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from kernel_ab import spec_bench_prompts
from policy_ab import ROOT, base_and_demo_pair
from specdec_cli.engine import SamplingParams
from specdec_cli.engine.batched import RowRequest
from specdec_cli.models.calibrate import machine
from specdec_cli.session import build_batched_decoder


def batch(decoder, requests: list[RowRequest]) -> dict:
    """One whole batch: its seconds, tokens per request, steps, drafted and accepted tokens."""
    start = time.perf_counter()
    results = decoder.generate_many(requests)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [result.tokens for result in results],
            **{count: sum(getattr(result.stats, count) for result in results)
               for count in ("steps", "drafted", "accepted")}}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    base, choice, target, draft = base_and_demo_pair(args.base, "specdec_cli/engine/batched.py", "base_batched")
    profile = choice.profile
    params = (SamplingParams(args.temperature, profile.top_k, profile.top_p, seed=0) if args.temperature
              else SamplingParams())
    requests = [RowRequest(prompt, params, 128) for prompt in
                spec_bench_prompts(target.tokenizer, profile.system, args.prompts)]
    versions = [args.base, "working tree"]
    runs = []
    for repeat in range(args.repeats):
        alone = batch(build_batched_decoder(target, None, "none", 0, args.batch_size), requests)
        runs.append({"repeat": repeat, "version": "target alone", **alone})
        for which in versions[:: 1 if repeat % 2 == 0 else -1]:
            decoder = build_batched_decoder(target, draft, "cascade", "auto", args.batch_size)
            if which != "working tree":
                decoder.__class__ = base.BatchedDecoder  # the same object and caches, the base's methods
            run = batch(decoder, requests)
            if params.greedy and run["tokens"] != alone["tokens"]:
                raise SystemExit(f"repeat {repeat}: the cascade ({which}) differs from the target alone")
            runs.append({"repeat": repeat, "version": which, **run})
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    summary = {}
    for version in ["target alone", *versions]:
        rows = [run for run in runs if run["version"] == version]
        tokens = sum(len(made) for run in rows for made in run["tokens"])
        rate = tokens / sum(run["seconds"] for run in rows)
        summary[version] = {"tokens_per_second": rate, **{count: sum(run[count] for run in rows)
                                                          for count in ("steps", "drafted", "accepted")}}
    for version, entry in summary.items():
        entry["speedup"] = entry["tokens_per_second"] / summary["target alone"]["tokens_per_second"]
        print(f"{version}: {entry['tokens_per_second']:.1f} tok/s x{entry['speedup']:.2f}, {entry['steps']} steps, "
              f"{entry['accepted']}/{entry['drafted']} drafted tokens accepted")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "base": args.base, "batch_size": args.batch_size,
            "temperature": args.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "base_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True,
                                          text=True).stdout.strip(),
            "max_new_tokens": 128, "summary": summary,
            "runs": [{key: value for key, value in run.items() if key != "tokens"} | {
                "new_tokens": [len(made) for made in run["tokens"]]} for run in runs]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
