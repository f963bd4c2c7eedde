"""Forward costs of the demo pair three ways, interleaved in one process: the torch lean path, the decoder layers
in C one call per layer half (layer_kernels.c), and the whole decoder stack in one C call (decoder_stack.stack_forward).
For each repeat and token count, one forward each way over its own cache. The paths compute the same layers (the
C ones up to rounding against torch, and the two C ones bit for bit), so only the time differs.

    python scripts/layers_ab.py --format q4 --json benchmarks/....json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types

import torch

from specdec_cli.engine.cache_layers import new_cache
from specdec_cli.models import lean_layers, load_model
from specdec_cli.models.calibrate import machine

MODELS = {"target": "demo:qwen2.5-coder-1.5b", "draft": "demo:qwen2.5-coder-0.5b"}
SIZES = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="q4")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    result = {"machine": machine(), "python": platform.python_version(), "format": args.format,
              "context_tokens": args.context, "repeats": args.repeats, "milliseconds": {}}
    for role, name in MODELS.items():
        model = load_model(name, dtype="bfloat16", quantization=args.format, progress=False, role=role).model
        result["milliseconds"][role] = rows = _interleaved(model, args.context, args.repeats)
        for path, row in rows.items():
            print(role, path, " ".join(f"{n}: {ms:.1f} ms" for n, ms in row.items()), flush=True)
        del model
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


@torch.inference_mode()
def _interleaved(model, context: int, repeats: int) -> dict:
    in_c, decoder = lean_layers._runs_in_c, model.model
    stack = decoder.forward

    def use(path: str) -> None:
        lean_layers._runs_in_c = (lambda *args: False) if path == "torch lean layers" else in_c
        decoder.forward = stack if path == "decoder stack in C" else types.MethodType(type(decoder).forward, decoder)

    paths = ("torch lean layers", "layers in C", "decoder stack in C")
    caches = {path: new_cache(model.config) for path in paths}
    times = {path: {n: [] for n in SIZES} for path in paths}
    generator = torch.Generator().manual_seed(0)
    try:
        for path, cache in caches.items():
            use(path)
            model(input_ids=torch.arange(100, 100 + context)[None], cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(repeats):
            for n in SIZES:
                ids = torch.randint(100, 1000, (1, n), generator=generator)
                for path, cache in caches.items():
                    use(path)
                    start = time.perf_counter()
                    model(input_ids=ids, cache=cache, use_cache=True)
                    times[path][n].append(time.perf_counter() - start)
                    cache.crop(context - cache.get_seq_length())  # 5.24: a negative count of positions to drop
    finally:
        use("decoder stack in C")
    return {path: {n: 1000 * statistics.median(values) for n, values in rows.items()} for path, rows in times.items()}


if __name__ == "__main__":
    main()
