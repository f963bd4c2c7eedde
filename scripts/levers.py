"""Measure each speed lever against the target alone, interleaved prompt by prompt in one process.

    python scripts/levers.py [--n-per-category 1] [--max-new-tokens 64] [--dtype bfloat16] [--only a,b]

Prints one row per configuration: speedup (total baseline seconds / total seconds), acceptance,
tokens per step, and how many prompts gave output identical to the baseline (greedy)."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, NgramDrafter
from specdec_cli.drafters.subset_head import frequent_token_ids
from specdec_cli.engine.draft import Draft
from specdec_cli.engine import AdaptiveK, CostModelK, DraftOrNot, FixedK, GenerationStats, SamplingParams, SpeculativeDecoder
from specdec_cli.models import load_pair
from specdec_cli.session import encode_chat, eos_token_ids

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared/prompts/spec_bench_questions.jsonl"


def spec_bench(n_per_category: int) -> list[tuple[str, str]]:
    taken: dict[str, int] = defaultdict(int)
    prompts = []
    for line in QUESTIONS.read_text().splitlines():
        record = json.loads(line)
        if taken[record["category"]] < n_per_category:
            taken[record["category"]] += 1
            prompts.append((record["category"], record["turns"][0]))
    return prompts


class ExtendedCascade(CascadeDrafter):
    """Experiment (greedy only): the cascade, with an n-gram continuation appended to the draft model's
    proposal. Measured with an int8 draft, k=3, 13 prompts x 64 tokens: x1.69 vs x1.66 without — within
    run-to-run noise, so it did not go into the product (it would need one-hot rows for sampling and
    policy accounting for the free tail)."""

    def propose(self, ids, k, params, generator):
        draft = super().propose(ids, k, params, generator)
        if draft.free or not len(draft):
            return draft
        self.ngram._index(ids)
        sequence = list(ids) + draft.ids
        for n in range(min(self.ngram.max_n, len(sequence) - 1), self.ngram.min_n - 1, -1):
            start = self.ngram._continuation_at.get(tuple(sequence[len(sequence) - n:]))
            if start is not None:
                return Draft(draft.ids + list(ids[start:start + 6]), None)
        return draft


def configurations(target, draft):
    subset = frequent_token_ids(draft.tokenizer, 32768, draft.vocab_size)
    model = lambda **kw: DraftModelDrafter(draft.model, **kw)  # noqa: E731
    int8 = []

    def model8(**kw):
        if not int8:
            import copy
            from specdec_cli.models.quant import quantize_int8_dynamic
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                int8.append(quantize_int8_dynamic(copy.deepcopy(draft.model)))
        return DraftModelDrafter(int8[0], **kw)
    return {
        "target": lambda: (None, FixedK(0)),
        "model k=3": lambda: (model(), FixedK(3)),
        "model k=5": lambda: (model(), FixedK(5)),
        "model adaptive": lambda: (model(), AdaptiveK()),
        "model cost": lambda: (model(), CostModelK()),
        "model cost +fr32k": lambda: (model(token_ids=subset), CostModelK()),
        "model cost +conf.4": lambda: (model(min_confidence=0.4), CostModelK()),
        "model cost +fr32k +conf.4": lambda: (model(token_ids=subset, min_confidence=0.4), CostModelK()),
        "model k=3 int8": lambda: (model8(), FixedK(3)),
        "model k=4 int8": lambda: (model8(), FixedK(4)),
        "model cost int8": lambda: (model8(), CostModelK()),
        "cascade k=4 int8": lambda: (CascadeDrafter(model8()), FixedK(4)),
        "cascade cost int8": lambda: (CascadeDrafter(model8()), CostModelK()),
        "cascade+ext k=3 int8": lambda: (ExtendedCascade(model8()), FixedK(3)),
        "cascade k=3 int8": lambda: (CascadeDrafter(model8()), FixedK(3)),
        "cascade cost int8 +fr32k": lambda: (CascadeDrafter(model8(token_ids=subset)), CostModelK()),
        "cascade cost16 int8": lambda: (CascadeDrafter(model8()), CostModelK(max_k=16)),
        "cascade cost16 int8 +fr32k": lambda: (CascadeDrafter(model8(token_ids=subset)), CostModelK(max_k=16)),
        "cascade cost20 int8 +surv.3": lambda: (CascadeDrafter(model8(min_survival=0.3)), CostModelK(max_k=20)),
        "cascade cost20 int8 +surv.2": lambda: (CascadeDrafter(model8(min_survival=0.2)), CostModelK(max_k=20)),
        "cascade k=20 int8 +surv.3": lambda: (CascadeDrafter(model8(min_survival=0.3)), FixedK(20)),
        "cascade k=20 int8 +surv.2": lambda: (CascadeDrafter(model8(min_survival=0.2)), FixedK(20)),
        "cascade k=20 int8 +surv.4": lambda: (CascadeDrafter(model8(min_survival=0.4)), FixedK(20)),
        "cascade auto int8": lambda: (CascadeDrafter(model8(min_survival=0.3)), DraftOrNot(max_k=20)),
        "cascade cost int8 +conf.4": lambda: (CascadeDrafter(model8(min_confidence=0.4)), CostModelK()),
        "cascade cost16 int8 +conf.4": lambda: (CascadeDrafter(model8(min_confidence=0.4)), CostModelK(max_k=16)),
        "cascade k=20 int8 +conf.4": lambda: (CascadeDrafter(model8(min_confidence=0.4)), FixedK(20)),
        "cascade k=12 int8 +conf.3": lambda: (CascadeDrafter(model8(min_confidence=0.3)), FixedK(12)),
        "ngram k=4": lambda: (NgramDrafter(), FixedK(4)),
        "ngram k=8": lambda: (NgramDrafter(), FixedK(8)),
        "cascade k=3": lambda: (CascadeDrafter(model()), FixedK(3)),
        "cascade cost": lambda: (CascadeDrafter(model()), CostModelK()),
        "cascade cost +fr32k +conf.4": lambda: (
            CascadeDrafter(model(token_ids=subset, min_confidence=0.4)), CostModelK()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--only", default="")
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    parser.add_argument("--upcast-fp32", action="store_true",
                        help="run the target (and the bf16 draft) in float32, loaded at --dtype (identity checks)")
    args = parser.parse_args()
    target, draft = load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", dtype=args.dtype)
    if args.upcast_fp32:
        target.model.float()
        draft.model.float()
    eos = eos_token_ids(target)
    configs = configurations(target, draft)
    if args.only:
        wanted = ["target"] + args.only.split(",")
        unknown = [name for name in wanted if name not in configs]
        if unknown:
            parser.error(f"unknown configuration(s) {unknown}; names are: {', '.join(configs)}")
        configs = {name: make for name, make in configs.items() if name in wanted}
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for _, q in spec_bench(args.n_per_category)]
    prompts = prompts[: args.limit] if args.limit else prompts
    seconds, stats, identical = defaultdict(float), defaultdict(GenerationStats), defaultdict(int)
    for name, make in configs.items():  # warm-up
        drafter, policy = make()
        SpeculativeDecoder(target.model, drafter, policy, eos).generate(prompts[0], SamplingParams(), 8)
    for number, prompt in enumerate(prompts):
        baseline_tokens = None
        for name, make in configs.items():
            drafter, policy = make()
            decoder = SpeculativeDecoder(target.model, drafter, policy, eos)
            started = time.perf_counter()
            result = decoder.generate(prompt, SamplingParams(), args.max_new_tokens)
            seconds[name] += time.perf_counter() - started
            stats[name].merge(result.stats)
            baseline_tokens = baseline_tokens if baseline_tokens is not None else result.tokens
            identical[name] += result.tokens == baseline_tokens
        print(f"prompt {number + 1}/{len(prompts)} done", flush=True)
    base = seconds["target"]
    print(f"\n{'configuration':32} {'speedup':>8} {'tok/s':>7} {'accept':>7} {'tok/step':>8} {'identical':>9}")
    for name in configs:
        s = stats[name]
        print(f"{name:32} {base / seconds[name]:8.2f} {s.new_tokens / seconds[name]:7.2f} "
              f"{s.acceptance_rate:7.2f} {s.tokens_per_step:8.2f} {identical[name]:4}/{len(prompts)}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
