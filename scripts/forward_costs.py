"""Forward-pass cost of the target and the draft for 1..8 new tokens on a warm cache.

Speculation pays only while verifying k tokens costs about as much as one: this prints, for the
chosen dtype / quantisation, the median seconds of a forward of n new tokens and its ratio to n=1.

    python scripts/forward_costs.py [--profile demo] [--dtype bfloat16] [--load-in-4bit] [--draft-int8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec_cli.engine.kv import CachedModel
from specdec_cli.models import load_pair
from specdec_cli.models.device import dtype_name
from specdec_cli.profiles import load_profile


def forward_seconds(model: torch.nn.Module, context: list[int], new_tokens: int, repeats: int) -> float:
    runner = CachedModel(model)
    runner.extend(context, 1)
    times = []
    for repeat in range(repeats + 1):
        extra = [(100 + 7 * repeat + i) % 1000 + 200 for i in range(new_tokens)]
        started = time.perf_counter()
        runner.extend(context + extra, new_tokens)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first run warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-in-4bit", action="store_true")
    parser.add_argument("--draft-int8", action="store_true", help="the draft in int8 (torch dynamic, CPU)")
    parser.add_argument("--upcast-fp32", action="store_true",
                        help="load at --dtype, then run in float32 (skips a second GGUF conversion)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    quantization = "4bit" if args.load_in_4bit else None
    target, draft = load_pair(profile.target, profile.draft, dtype=args.dtype, target_quantization=quantization,
                              draft_quantization="int8" if args.draft_int8 else quantization)
    if args.upcast_fp32:
        for loaded in (target, draft):
            if loaded is not None and loaded.quantization is None:
                loaded.model.float()
                loaded.dtype = torch.float32
    context = [(31 * i) % 5000 + 100 for i in range(args.context)]
    print(f"threads={torch.get_num_threads()} dtype={target.dtype} quantization={quantization} context={args.context}")
    for loaded in (target, draft):
        if loaded is None:
            continue
        one = forward_seconds(loaded.model, context, 1, args.repeats)
        costs = {n: forward_seconds(loaded.model, context, n, args.repeats) for n in (2, 4, 8)}
        line = "  ".join(f"n={n}: {1000 * s:.0f} ms (x{s / one:.2f})" for n, s in costs.items())
        print(f"{loaded.name} ({loaded.quantization or dtype_name(loaded.dtype)}): n=1: {1000 * one:.0f} ms  {line}")


if __name__ == "__main__":
    main()
