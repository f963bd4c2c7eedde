"""Forward costs of the demo pair in two formats, interleaved in one process (this VM drifts by up to ±20%
within the hour, so formats timed one after the other, as `specdec calibrate` does, are not comparable to a
few percent). For each model, each token count and each repeat, one forward per format in turn; the median.
The forwards go over the engine's cache (engine/kv.py), so a decoder that runs in one C call does here too.

    python scripts/format_ab.py --formats int8,q4 --json benchmarks/....json

--generate N instead times whole generations with the target in each format: the first question of each
Spec-Bench category (N of them) through the demo profile as `compare` runs it (its chat template and system
prompt, 128 new tokens, greedy, prefill included), the target alone and the profile's drafter with its draft
as the profile loads it, each target format in turn (the order alternating per prompt). Each format's outputs
must agree between the target alone and the drafter; between formats they may differ (other weights).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from specdec_cli.engine.cache_layers import new_cache
from specdec_cli.models import load_model
from specdec_cli.models.calibrate import machine

MODELS = {"target": "demo:qwen2.5-coder-1.5b", "draft": "demo:qwen2.5-coder-0.5b"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="int8,q4")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--generate", type=int, default=0, help="time generations of N prompts instead")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    formats = args.formats.split(",")
    result = {"machine": machine(), "python": platform.python_version(), "context_tokens": args.context,
              "repeats": args.repeats, "milliseconds": {}}
    if args.generate:
        result["generations"] = _generations(formats, args.generate)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=1)
        return
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
        caches[fmt] = new_cache(model.config)
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


@torch.inference_mode()
def _generations(formats: list[str], count: int) -> dict:
    from kernel_ab import spec_bench_prompts  # the same prompts (this folder is on sys.path)

    from specdec_cli.engine import SamplingParams
    from specdec_cli.session import build_decoder
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    pairs = {fmt: load_choice(choose_models(ModelOverrides(profile="demo", target_quant=fmt))) for fmt in formats}
    choice = choose_models(ModelOverrides(profile="demo"))
    prompts = spec_bench_prompts(pairs[formats[0]][0].tokenizer, choice.profile.system, count)
    drafters = ("none", choice.drafter)
    seconds = {fmt: {drafter: 0.0 for drafter in drafters} for fmt in formats}
    tokens = {fmt: {drafter: 0 for drafter in drafters} for fmt in formats}
    same = {fmt: 0 for fmt in formats[1:]}
    for index, prompt in enumerate(prompts):
        made_by = {}
        for fmt in formats[:: 1 if index % 2 == 0 else -1]:
            target, draft = pairs[fmt]
            outputs = []
            for drafter in drafters:
                decoder = build_decoder(target, draft, drafter, "auto")
                start = time.perf_counter()
                made = [token for event in decoder.stream(prompt, SamplingParams(), 128) for token in event.tokens]
                seconds[fmt][drafter] += time.perf_counter() - start
                tokens[fmt][drafter] += len(made)
                outputs.append(made)
            if outputs[0] != outputs[1]:
                raise SystemExit(f"prompt {index}: {fmt}: the drafter's output differs from the target alone's")
            made_by[fmt] = outputs[0]
        for fmt in same:
            same[fmt] += made_by[fmt] == made_by[formats[0]]
        print(f"prompt {index + 1}/{len(prompts)}: " + ", ".join(f"{fmt} {len(made)} tokens" for fmt, made in
                                                                 made_by.items()), flush=True)
    rates = {fmt: {drafter: tokens[fmt][drafter] / seconds[fmt][drafter] for drafter in drafters} for fmt in formats}
    for fmt, row in rates.items():
        print(f"target {fmt:6}", " ".join(f"{drafter}: {rate:.1f} tok/s" for drafter, rate in row.items()),
              f"(x{row[choice.drafter] / row['none']:.2f})")
    return {"prompts": len(prompts), "max_new_tokens": 128, "drafter": choice.drafter,
            "draft_quantization": pairs[formats[0]][1].quantization if pairs[formats[0]][1] else None,
            "seconds": seconds, "tokens": tokens, "tokens_per_second": rates,
            f"outputs_identical_to_{formats[0]}": same}


if __name__ == "__main__":
    main()
