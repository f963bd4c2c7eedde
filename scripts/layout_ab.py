"""q4's two layouts of the demo target's Q4_K layers against each other, interleaved in one process: layout 1 (a
.gguf's Q4_K blocks as they are, 4.625 bits a weight: q4.Q4KLinear) and layout 0 (step and minimum per group in
float16, 5 bits a weight: how q4 held them until 2026-12-05, the weights rounded by up to 2⁻¹¹ of a group's range).

    python scripts/layout_ab.py [--repeats 20] [--generate 13] --json benchmarks/....json

The demo target is loaded as q4 once; the other model is the same one with every Q4KLinear (the fused ones too) turned
into layout 0 (`q4_parts`). Forwards of 1 / 2 / 4 / 8 new tokens over a 200-token cache alternate between the two, the
decoder and the output head timed apart (as scripts/kernel_ab.py does for two builds of the kernels). --generate N
also times whole generations as `compare` runs them (the first question of N Spec-Bench categories, the demo profile's
template and system prompt, 128 new tokens, greedy): the target alone and the profile's drafter, for each layout in
turn (the order alternating per prompt), a fresh decoder each time. Within a layout the drafter's tokens must be the
target's; between layouts they may differ (other weights), so the comparison is tokens/s."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from kernel_ab import generation_rates, spec_bench_prompts, timed_generation
from specdec_cli.engine.cache_layers import new_cache
from specdec_cli.models.calibrate import machine
from specdec_cli.models.q4 import Q4KLinear, Q4Linear

SIZES = (1, 2, 4, 8)


def as_layout_0(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every Q4KLinear in layout 0; returns it and how many layers changed."""
    other = copy.deepcopy(model)
    changed = 0
    for parent in list(other.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Q4KLinear):
                setattr(parent, name, Q4Linear.from_parts(*child.q4_parts(), child.bias, child.in_features))
                changed += 1
    return other, changed


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(module.packed_weight.numel() for module in model.modules() if isinstance(module, Q4Linear))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--generate", type=int, default=0, help="also time generations of N prompts")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    choice = choose_models(ModelOverrides(profile="demo", target_quant="q4", draft_quant="q4"))
    target, draft = load_choice(choice)
    old_model, changed = as_layout_0(target.model)
    models = {"layout 1": target.model, "layout 0": old_model}
    result = {"machine": machine(), "target": choice.target, "layers_in_layout_1": changed,
              "bytes": {which: weight_bytes(model) for which, model in models.items()},
              "context_tokens": args.context, "repeats": args.repeats}
    print(f"{changed} layers in layout 1; q4 bytes", result["bytes"], flush=True)
    result["milliseconds"] = rows = _interleaved(models, args.context, args.repeats)
    for which, parts in rows.items():
        for part, row in parts.items():
            print(f"{which:9} {part:7}", " ".join(f"{n}: {ms:.1f} ms" for n, ms in row.items()), flush=True)
    if args.generate:
        result["generations"] = _generations(choice, target, draft, models, args.generate)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


@torch.inference_mode()
def _interleaved(models: dict, context: int, repeats: int) -> dict:
    caches = {which: new_cache(model.config) for which, model in models.items()}
    times = {which: {part: {n: [] for n in SIZES} for part in ("decoder", "head")} for which in models}
    generator = torch.Generator().manual_seed(0)
    for which, model in models.items():
        model(input_ids=torch.arange(100, 100 + context)[None], cache=caches[which], use_cache=True, logits_to_keep=1)
    for repeat in range(repeats):
        for n in SIZES:
            ids = torch.randint(100, 1000, (1, n), generator=generator)
            for which in list(models)[:: 1 if repeat % 2 == 0 else -1]:
                model, cache = models[which], caches[which]
                start = time.perf_counter()
                hidden = model.model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
                middle = time.perf_counter()
                model.lm_head(hidden)
                end = time.perf_counter()
                times[which]["decoder"][n].append(middle - start)
                times[which]["head"][n].append(end - middle)
                cache.crop(context - cache.get_seq_length())  # 5.24: a negative count of positions to drop
    return {which: {part: {n: 1000 * statistics.median(values) for n, values in rows.items()}
                    for part, rows in parts.items()} for which, parts in times.items()}


@torch.inference_mode()
def _generations(choice, target, draft, models: dict, count: int) -> dict:
    from dataclasses import replace

    from specdec_cli.session import build_decoder

    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, count)
    targets = {which: replace(target, model=model) for which, model in models.items()}
    drafters = ("none", choice.drafter)
    seconds = {which: {drafter: 0.0 for drafter in drafters} for which in models}
    tokens = {which: {drafter: 0 for drafter in drafters} for which in models}
    for index, prompt in enumerate(prompts):
        for which in list(models)[:: 1 if index % 2 == 0 else -1]:
            outputs = []
            for drafter in drafters:
                made, spent = timed_generation(build_decoder(targets[which], draft, drafter, "auto"), prompt)
                seconds[which][drafter] += spent
                tokens[which][drafter] += len(made)
                outputs.append(made)
            if outputs[1] != outputs[0]:
                raise SystemExit(f"prompt {index}, {which}: the drafter's output is not the target's")
        print(f"prompt {index + 1}/{len(prompts)}", flush=True)
    return generation_rates(seconds, tokens, choice.drafter, len(prompts))


if __name__ == "__main__":
    main()
