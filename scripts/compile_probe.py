"""Does torch.compile pay on this CPU? Times forwards of 1 and 4 new tokens of one model in one format,
eager and compiled (inductor, dynamic shapes: the cache grows every step), on a warm 200-token cache,
and prints the compile time and the per-forward medians as JSON.

    python scripts/compile_probe.py [--model demo:qwen2.5-coder-1.5b] [--quantization int8] [--repeats 8]

Measure on an idle machine; the first compiled calls include compilation (reported apart)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec_cli.engine.kv import CachedModel
from specdec_cli.models import load_model
from specdec_cli.models.calibrate import machine


def forward_ms(runner: CachedModel, context: list[int], n: int, repeats: int, offset: int) -> list[float]:
    times = []
    for repeat in range(repeats):
        extra = [5 + 7 * i + 1000 * (repeat + offset) for i in range(n)]
        started = time.perf_counter()
        runner.extend(context + extra, n)
        times.append(1000 * (time.perf_counter() - started))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo:qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="bfloat16", quantization=None if args.quantization == "none" else args.quantization,
                        progress=False)
    context = [3 + (31 * i) % 5000 for i in range(200)]
    result = {"machine": machine(), "model": args.model, "precision": loaded.precision}
    eager = CachedModel(loaded.model)
    eager.extend(context, 1)
    for n in (1, 4):
        result[f"eager_ms_{n}"] = statistics.median(forward_ms(eager, context, n, args.repeats, 0))
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights as constants: the prepacked int8 weights must be, for the qlinear lowering
    loaded.model.forward = torch.compile(loaded.model.forward, dynamic=True)
    compiled = CachedModel(loaded.model)
    started = time.perf_counter()
    compiled.extend(context, 1)
    for n in (1, 4):
        first = forward_ms(compiled, context, n, 2, 100)  # compiles (and may recompile) here
        result[f"first_calls_ms_{n}"] = first
        result[f"compiled_ms_{n}"] = statistics.median(forward_ms(compiled, context, n, args.repeats, 200))
    result["compile_and_first_calls_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
