"""Forward costs of the demo pair in two formats, interleaved in one process (this VM drifts by up to ±20%
within the hour, so formats timed one after the other, as `specdec calibrate` does, are not comparable to a
few percent). For each model, each token count and each repeat, one forward per format in turn; the median.

    python scripts/format_ab.py --formats int8,q4 --json benchmarks/....json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import DynamicCache

from specdec_cli.models import load_model
from specdec_cli.models.calibrate import machine

MODELS = {"target": "demo:qwen2.5-coder-1.5b", "draft": "demo:qwen2.5-coder-0.5b"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="int8,q4")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    formats = args.formats.split(",")
    result = {"machine": machine(), "python": platform.python_version(), "context_tokens": args.context,
              "repeats": args.repeats, "milliseconds": {}}
    for role, name in MODELS.items():
        models = {fmt: load_model(name, dtype="bfloat16", quantization=fmt, progress=False, role=role).model
                  for fmt in formats}
        result["milliseconds"][role] = _interleaved(models, args.context, args.repeats)
        for fmt, row in result["milliseconds"][role].items():
            print(role, fmt, " ".join(f"{n}: {ms:.1f} ms" for n, ms in row.items()), flush=True)
        del models
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


@torch.inference_mode()
def _interleaved(models: dict, context: int, repeats: int) -> dict:
    caches = {}
    prompt = torch.arange(100, 100 + context)[None]
    for fmt, model in models.items():
        caches[fmt] = DynamicCache(config=model.config)
        model(input_ids=prompt, cache=caches[fmt], use_cache=True, logits_to_keep=1)
    times = {fmt: {n: [] for n in (1, 2, 4, 8)} for fmt in models}
    generator = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        for n in (1, 2, 4, 8):
            ids = torch.randint(100, 1000, (1, n), generator=generator)
            for fmt, model in models.items():
                cache = caches[fmt]
                if cache.get_seq_length() > context:
                    cache.crop(context - cache.get_seq_length())  # 5.24: a negative count of positions to drop
                start = time.perf_counter()
                model(input_ids=ids, cache=cache, use_cache=True)
                times[fmt][n].append(time.perf_counter() - start)
    return {fmt: {n: 1000 * statistics.median(values) for n, values in rows.items()} for fmt, rows in times.items()}


if __name__ == "__main__":
    main()
