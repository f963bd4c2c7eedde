"""How fast the demo pair's q4 target reads a prompt: by itself (q4's own matmul), through its bfloat16 copy, and through
its own weights on AMX in bfloat16 (`--prefill`, models/prefill.py), alternated in one process.

    python scripts/prompt_read_ab.py [--lengths 24,32,64,128,256,700] [--repeats 3] --json benchmarks/....json

Per length, each way reads the same prompt (the first question of Spec-Bench's summarization category, as `compare`
encodes it, cut to the length) from an empty cache, the order of the ways rotating per repeat; the median is kept.
"q4" is `CachedModel.extend` (it also makes the last token's logits: one row of the head, ~6 ms); the two paths are
`CachedModel.prefill`, each taking every length (the copy's own threshold is set to 1 here). The copy is loaded once,
its load timed. The third way needs a CPU with AMX-BF16; without one the first two are timed."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kernel_ab import spec_bench_prompts
from specdec_cli.engine.kv import PREFILL_PATH, CachedModel
from specdec_cli.models.calibrate import machine

WAYS = ("q4", "bf16 copy", "bf16 on AMX")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="24,32,48,64,128,192,256,512,700")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from specdec_cli.models import prefill
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    choice = choose_models(ModelOverrides(profile="demo", prefill="none", drafter="ngram"))
    target, _ = load_choice(choice)
    ways = WAYS if prefill.amx_reads(target) else WAYS[:2]
    if len(ways) < len(WAYS):
        print("this CPU (or this target) cannot read prompts on AMX in bfloat16: q4 and the copy only", flush=True)
    started = time.perf_counter()
    paths = {"bf16 copy": prefill.load_copy(target, min_tokens=1, progress=False)}
    if "bf16 on AMX" in ways:
        paths["bf16 on AMX"] = prefill.AmxPromptPath(target.model, min_tokens=1)
    load_seconds = time.perf_counter() - started
    text = spec_bench_prompts(target.tokenizer, choice.profile.system, 13)[9]  # summarization: 700 tokens
    rows = []
    for length in (int(part) for part in args.lengths.split(",")):
        ids = (text * (length // len(text) + 1))[:length]
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for way in ways[repeat % len(ways):] + ways[:repeat % len(ways)]:
                timing = _read(target.model, paths.get(way), ids)
                if repeat:
                    seconds[way].append(timing)
        row = {"tokens": length, **{way: statistics.median(values) for way, values in seconds.items()}}
        rows.append(row)
        print(f"{length:4} tokens: " + "  ".join(f"{way} {row[way]:.3f} s" for way in ways), flush=True)
    result = {"machine": machine(), "target": target.describe("target"), "copy_load_seconds": load_seconds,
              "repeats": args.repeats, "amx_piece": prefill.AMX_PIECE, "reads": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


@torch.inference_mode()
def _read(model: torch.nn.Module, path, ids: list[int]) -> float:
    if path is None:
        model.__dict__.pop(PREFILL_PATH, None)
    else:
        model.__dict__[PREFILL_PATH] = path
    runner = CachedModel(model)
    started = time.perf_counter()
    runner.extend(ids, 1) if path is None else runner.prefill(ids)
    elapsed = time.perf_counter() - started
    model.__dict__.pop(PREFILL_PATH, None)
    return elapsed


if __name__ == "__main__":
    main()
